"""``tangram profile`` end to end: real commands through the local executor.

The contract test sweeps the shipped real pytest project
(profiling/fixtures/algo_suite) at DoP 1 and 2 with pytest-xdist.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the profiling extra is missing: pip install '.[profiling]'")

from tangram.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "profiling" / "fixtures" / "algo_suite"
PY = shlex.quote(sys.executable)  # the interpreter running the tests (a bare `python` may not exist)
PYTEST_CMD = PY + " -m pytest -q -p no:cacheprovider -n ${parallel_num}"


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tangram.cli", "profile", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_contract_on_real_pytest_suite_with_xdist(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist missing")
    out = tmp_path / "store" / "profiles.json"
    p = _cli("--name", "algo-suite", "--command", PYTEST_CMD, "--workdir", str(SUITE),
             "--dop", "1,2", "--repeats", "1", "--warmups", "0", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    entry = doc["classes"]["algo-suite"]
    assert isinstance(entry["t1_s"], float) and entry["t1_s"] > 0
    assert set(entry["efficiency"]) >= {"1", "2"}
    assert all(isinstance(v, float) and 0 < v <= 1 for v in entry["efficiency"].values())
    assert isinstance(entry["samples"], int) and entry["samples"] == 2
    assert doc["version"] == 1
    # each measured sample is in the JSONL next to the store, keyed by class/dop/repeat
    log = out.parent / "profiles.json.samples.jsonl"
    recs = _jsonl(log)
    assert sorted((r["class"], r["dop"], r["repeat"]) for r in recs) == [("algo-suite", 1, 0), ("algo-suite", 2, 0)]
    # a rerun finds every point done: it measures nothing and rewrites the same fit
    p2 = _cli("--name", "algo-suite", "--command", PYTEST_CMD, "--workdir", str(SUITE),
              "--dop", "1,2", "--repeats", "1", "--warmups", "0", "--out", str(out))
    assert p2.returncode == 0, p2.stderr
    assert len(_jsonl(log)) == 2
    assert json.loads(out.read_text())["classes"]["algo-suite"]["t1_s"] == entry["t1_s"]


@pytest.mark.parametrize("command,needle", [
    ("nosuch-command-tangram -n ${parallel_num}", "command not found"),  # unknown command
    (PY + " -m pytest -q -p no:cacheprovider no_such_tests_dir", "no_such_tests_dir"),  # pytest fails
    (PY + " -c 'import sys; sys.stderr.write(\"boom-${parallel_num}\\n\"); sys.exit(3)'", "boom-"),
])
def test_failing_command_exits_nonzero_and_writes_nothing(tmp_path, command, needle):
    work = tmp_path / "work"
    work.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = _cli("--name", "broken", "--command", command, "--workdir", str(work), "--dop", "1,2",
             "--repeats", "1", "--out", str(out_dir / "p.json"), timeout=60)
    assert p.returncode != 0
    assert needle in p.stderr
    assert list(out_dir.iterdir()) == []  # no store, no samples file


COUNTER_CMD = (PY + " -c \"import os; open('runs.txt', 'a').write('${parallel_num} ' + "
               "str(len(os.sched_getaffinity(0))) + chr(10)); sum(range(2 * 10**5))\"")


# These tests check the sweep's bookkeeping, not the fit: a 60 ms command timed beside a loaded test run
# can read any spread, so they accept any cross-validated error.
ANY_NOISE = ["--max-cv-error", "1e9"]


def _runs(work: Path) -> list[tuple[int, int]]:
    f = work / "runs.txt"
    return [tuple(int(x) for x in line.split()) for line in f.read_text().splitlines()] if f.exists() else []


def test_resume_does_not_redo_finished_points(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "p.json"
    args = ["profile", "--name", "counter", "--command", COUNTER_CMD, "--workdir", str(work), "--dop", "1,2",
            "--repeats", "2", "--warmups", "0", "--out", str(out), "--no-progress", *ANY_NOISE]
    assert main(args) == 0
    assert len(_runs(work)) == 4
    log = tmp_path / "p.json.samples.jsonl"
    # simulate a kill after the second point: two lines kept, the third cut in half
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])
    out.unlink()
    (work / "runs.txt").unlink()
    assert main(args) == 0
    assert len(_runs(work)) == 2  # only the two missing points ran again
    recs = _jsonl_tolerant(log)
    assert sorted((r["dop"], r["repeat"]) for r in recs) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert json.loads(out.read_text())["classes"]["counter"]["samples"] == 4
    # a changed command does not reuse the old samples
    args2 = list(args)
    args2[args2.index(COUNTER_CMD)] = COUNTER_CMD + " && true"
    (work / "runs.txt").unlink()
    assert main(args2) == 0
    assert len(_runs(work)) == 4


def _jsonl_tolerant(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_cores_are_pinned_per_dop(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    work = tmp_path / "work"
    work.mkdir()
    assert main(["profile", "--name", "pin", "--command", COUNTER_CMD, "--workdir", str(work), "--dop", "1,2",
                 "--repeats", "1", "--warmups", "1", "--out", str(tmp_path / "p.json"), "--no-progress", *ANY_NOISE]) == 0
    # (DoP rendered into the command, cores the process could use): DoP 1 really saw one core
    assert sorted(set(_runs(work))) == [(1, 1), (2, 2)]


def test_yaml_config_two_classes_one_failing(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"""
out: {tmp_path / 'p.json'}
executor: local
max_cv_error: 1.0e9
defaults: {{repeats: 1, warmups: 0, dops: [1, 2]}}
classes:
  good:
    command: {json.dumps(COUNTER_CMD)}
    workdir: {work}
  bad:
    command: exit 7
    workdir: {work}
""")
    rc = main(["profile", "--config", str(cfg), "--no-progress"])
    assert rc == 1
    doc = json.loads((tmp_path / "p.json").read_text())
    assert set(doc["classes"]) == {"good"} and "bad" not in doc["unfit"]
    assert "exit code 7" in capsys.readouterr().err


def test_unfit_class_is_kept_under_unfit_and_exits_nonzero(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "p.json"
    rc = main(["profile", "--name", "one-dop", "--command", COUNTER_CMD, "--workdir", str(work), "--dop", "1",
               "--repeats", "2", "--warmups", "0", "--out", str(out), "--no-progress"])
    assert rc == 1
    doc = json.loads(out.read_text())
    assert doc["classes"] == {}
    assert "distinct DoPs" in doc["unfit"]["one-dop"]["reason"]
    assert "unfit" in capsys.readouterr().err


def test_usage_errors(tmp_path):
    assert main(["profile", "--name", "x", "--out", str(tmp_path / "p.json")]) == 2  # no command
    assert main(["profile", "--name", "x", "--command", "true", "--dop", "1,a",
                 "--out", str(tmp_path / "p.json")]) == 2
    assert main(["profile", "--name", "x", "--command", "true", "--workdir", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "p.json")]) == 2
    assert not (tmp_path / "p.json").exists()


@pytest.mark.docker
def test_docker_image_gets_a_copy_of_the_workdir(tmp_path, docker_client):
    from tangram.executors.docker_image import SANDBOX_IMAGE

    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text("from-the-host\n")
    out = tmp_path / "p.json"
    cmd = ("grep -q from-the-host marker.txt && python3 -c \"import os; assert len(os.sched_getaffinity(0)) == "
           "${parallel_num}, os.sched_getaffinity(0)\"")
    rc = main(["profile", "--name", "in-docker", "--command", cmd, "--workdir", str(work), "--image", SANDBOX_IMAGE,
               "--dop", "1,2", "--repeats", "1", "--warmups", "0", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert json.loads(out.read_text())["classes"]["in-docker"]["samples"] == 2


def test_env_flag_reaches_the_command(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    rc = main(["profile", "--name", "env", "--command", 'test "$TANGRAM_TEST_FOO" = bar-${parallel_num}',
               "--workdir", str(work), "--dop", "1,2", "--repeats", "1", "--warmups", "0",
               "--env", "TANGRAM_TEST_FOO=bar-2", "--out", str(tmp_path / "p.json"), "--no-progress"])
    assert rc == 1  # DoP 1 renders bar-1 != bar-2: the command fails, so the variable did arrive
    assert not (tmp_path / "p.json").exists()


def test_narrower_rerun_fits_only_its_own_dops(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "p.json"
    base = ["profile", "--name", "c", "--command", COUNTER_CMD, "--workdir", str(work), "--warmups", "0",
            "--out", str(out), "--no-progress", *ANY_NOISE]
    assert main(base + ["--dop", "1,2", "--repeats", "2"]) == 0
    (work / "runs.txt").unlink()
    assert main(base + ["--dop", "1,2", "--repeats", "1"]) == 0  # everything already measured
    assert not (work / "runs.txt").exists()
    entry = json.loads(out.read_text())["classes"]["c"]
    assert entry["samples"] == 2 and entry["dops"] == [1, 2]
