"""``tangram demo --workload deepsearch|mopd`` end to end at a small size: real search
service over the offline corpus, real teacher models, the shared demo JSON shape."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

SHAPE = ("mean_act_s", "p50_act_s", "p99_act_s", "step_time_s", "runs")


def run_demo(tmp_path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "demo", *args, "--out", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_deepsearch_demo_through_the_pool_sees_no_429(tmp_path):
    pytest.importorskip("bm25s", reason="pip install -r scripts/test-requirements.txt")
    doc = run_demo(tmp_path, "--workload", "deepsearch", "--trajectories", "3", "--max-searches", "4",
                   "--gap-s", "0.05", "--api-limits", "2,4,0.5", "--repeats", "2")
    assert doc["workload"] == "deepsearch" and set(doc) >= {"policies", "ratios", "projection", "machine"}
    pols = doc["policies"]
    assert set(pols) == {"tangram", "naive-retry", "naive-persistent"}
    for name, p in pols.items():
        assert all(k in p for k in SHAPE), name
        assert len(p["runs"]) == 2 and p["searches"] == sum(r["searches"] for r in p["runs"]) == 2 * 3 * 4
        assert 0 < p["p50_act_s"] <= p["p99_act_s"] and p["step_time_s"] > 0
    t = pols["tangram"]
    assert t["caller_429s"] == 0 and t["failed"] == 0 and t["retries"] == 0
    assert t["upstream_429s_sent"] == 0  # the search service never had to refuse us
    # 12 searches per run on 4 per 0.5 s: the naive callers do collide with the limits
    assert pols["naive-retry"]["caller_429s"] == pols["naive-retry"]["upstream_429s_sent"] > 0
    assert set(doc["ratios"]) == {"naive-retry", "naive-persistent"}
    assert json.loads((tmp_path / "deepsearch-summary.json").read_text())["policies"]["tangram"]["searches"] == 24


def test_workload_flags_are_checked(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "demo", "--workload", "deepsearch",
                           "--api-limits", "3,x,2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--api-limits" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "demo", "--workload", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--workload" in proc.stderr


@pytest.mark.slow
def test_mopd_demo_evicts_and_restores_real_teachers(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gguf", reason="pip install -r scripts/test-requirements.txt")
    doc = run_demo(tmp_path, "--workload", "mopd", "--trajectories", "2", "--gap-s", "0.05", "--repeats", "1")
    assert doc["workload"] == "mopd" and set(doc) >= {"policies", "ratios", "projection", "machine"}
    pols = doc["policies"]
    assert set(pols) == {"tangram", "static"}
    for name, p in pols.items():
        assert all(k in p for k in SHAPE), name
        assert p["actions"] == 4 and p["failed"] == 0 and len(p["runs"]) == 1
        assert p["smollm2_mean_value"] < 0 and 0 < p["minilm_mean_value"] <= 1
    # the same models scored the same text: the same values under both deployments
    assert pols["tangram"]["smollm2_mean_value"] == pols["static"]["smollm2_mean_value"]
    t, s = pols["tangram"], pols["static"]
    # one device that holds one teacher at a time: the second teacher of a trajectory needs a restore
    assert (t["devices"], s["devices"]) == (1, 2)
    assert t["restores"] >= 2 and t["restore_s"] > 0
    assert t["restore_share"] == pytest.approx(t["runs"][0]["restore_share"]) and 0 < t["restore_share"] < 1
    assert s["restores"] == 0 and s["restore_share"] == 0  # a server per model, warmed before the run
    assert t["peak_device_mb"] <= doc["spec"]["device_mb"] < s["peak_device_mb"]
    if doc["device"] == "cpu":
        assert any("virtual devices on the CPU" in n for n in doc["notes"])


def test_mopd_restore_share_is_of_restore_plus_run():
    """A restore slower than the runs it serves is a share under 1 of the devices' busy time (as the simulator's)."""
    from tangram.demo.mopd import MopdResult, TeacherSample, summarize

    r = MopdResult(samples=[TeacherSample("smollm2", 4.0, 0.5, True, -1.0), TeacherSample("minilm", 4.0, 0.5, True, 0.5)],
                   step_time_s=5.0, restores=2, restore_s=3.0)
    assert summarize(r)["restore_share"] == pytest.approx(3.0 / (3.0 + 1.0))
    assert summarize(MopdResult())["restore_share"] == 0.0
