"""scripts/replicate_paper.py and scripts/bench_simulator.py run end to end (tiny sizes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_replicate_paper_smoke_writes_json_and_plots(tmp_path, capsys):
    rp = load("replicate_paper")
    assert rp.main(["--smoke", "--out", str(tmp_path), "--only", "cpu_scaling", "ablation", "breakdown"]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["mode"] == "smoke" and set(head["cpu_scaling_act_ratio"]) == {"16", "32"}
    res = json.loads((tmp_path / "results.json").read_text())
    for row in res["cpu_scaling"]["rows"]:
        assert row["lower_bound_mean_act_s"] <= row["tangram"]["mean_act_s"]
    assert {p.name for p in tmp_path.glob("*.png")} == {"cpu_scaling.png", "ablation.png", "breakdown.png"}


def test_bench_simulator_json(capsys):
    bench = load("bench_simulator")
    assert bench.main(["--batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["actions"] > 0 and out["actions_per_s"] > 0
