"""Replicas of a seed (tangram.simulator.replicas) and scripts/noise_spread.py, which judges a loss against them."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tangram.simulator.replicas import REPLICA_JITTER_S
from tangram.simulator.sim import Simulation, simulate
from tangram.simulator.workload import load_workload
from tests.test_simulator_scripts import ROOT, load

MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def _gaps(sim: Simulation, step: int = 0) -> dict[str, list[float]]:
    return {tr.id: [it.gen_s for it in tr.items] for tr in sim._scripts(step)}


def test_replica_zero_is_the_seeds_own_run():
    wl = load_workload("mopd+search").with_batch(24)
    plain = simulate(wl, "tangram", seed=3).summary
    zero = simulate(wl, "tangram", seed=3, replica=0).summary
    assert zero == plain and "replica" not in zero
    assert _gaps(Simulation(wl, "tangram", seed=3)) == _gaps(Simulation(wl, "tangram", seed=3, replica=0))


def test_a_replica_moves_every_generation_gap_by_under_half_the_jitter_either_way_the_same_for_every_policy():
    wl = load_workload("deepsearch").with_batch(32)
    base = _gaps(Simulation(wl, "tangram", seed=1))
    one = _gaps(Simulation(wl, "tangram", seed=1, replica=1))
    assert one.keys() == base.keys()
    moves = []
    for tid, gaps in base.items():
        for g0, g1 in zip(gaps, one[tid], strict=True):
            if g0 == 0:
                assert g1 == 0  # a reward straight after the previous one keeps no generation
            else:
                assert g1 >= 0 and abs(g1 - g0) < REPLICA_JITTER_S / 2
                moves.append(g1 - g0)
    assert len(moves) > 32
    # about as many earlier as later, averaging near zero: the replicas scatter around the seed's run
    assert min(moves) < 0 < max(moves)
    assert abs(sum(moves) / len(moves)) < REPLICA_JITTER_S / 10
    # every policy sees the same perturbed work on a replica, and another replica other work
    assert _gaps(Simulation(wl, "api-retry", seed=1, replica=1)) == one
    assert _gaps(Simulation(wl, "static-services", seed=1, replica=1)) == one
    assert _gaps(Simulation(wl, "tangram", seed=1, replica=2)) != one
    # the second step's gaps move too, by their own draws
    assert _gaps(Simulation(wl, "tangram", seed=1, replica=1), 1) != _gaps(Simulation(wl, "tangram", seed=1), 1)


def test_a_replica_is_deterministic_and_moves_the_result():
    wl = load_workload("mopd+search").with_batch(48)
    a = simulate(wl, "tangram", seed=0, replica=1).summary
    b = simulate(wl, "tangram", seed=0, replica=1).summary
    zero = simulate(wl, "tangram", seed=0).summary
    assert a == b and a["replica"] == 1
    assert a["actions"] == zero["actions"]  # the same work
    assert any(a[m] != zero[m] for m in MEASURES)


def test_the_api_retry_backoff_draws_from_each_replicas_own_stream():
    wl = load_workload("deepsearch").with_batch(64)
    zero = Simulation(wl, "api-naive", seed=0)
    one = Simulation(wl, "api-naive", seed=0, replica=1)
    assert [zero._rng.random() for _ in range(4)] != [one._rng.random() for _ in range(4)]
    # replica 0 keeps the stream every stored run drew from
    assert Simulation(wl, "api-naive", seed=7, replica=0)._rng.random() == random.Random("7/jitter").random()


def test_the_simulate_command_takes_a_replica_and_refuses_a_negative_one():
    args = [sys.executable, "-m", "tangram.cli", "simulate", "--workload", "mopd-skewed", "--batch", "16", "--json"]
    out = subprocess.run([*args, "--replica", "2"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1])["replica"] == 2
    bad = subprocess.run([*args, "--replica", "-1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--replica: must be 0 or more, got -1" in bad.stderr


def _runs(*triples):
    return [dict(zip(MEASURES, t), failed=0) for t in triples]


def test_noise_spread_judges_each_measure_against_the_replicas_spread_and_pairs_them():
    ns = load("noise_spread")
    runs = {
        "tangram": _runs((1.0, 10.0, 100.0), (1.2, 11.0, 101.0), (1.1, 12.0, 102.0)),
        # mean: spreads overlap; p99: every replica lower than tangram's lowest; step: higher throughout
        "b": _runs((1.15, 8.0, 110.0), (1.05, 9.0, 111.0), (1.3, 9.5, 112.0)),
    }
    got = ns.compare_point(runs)["b"]
    assert got["failed_calls"] is False
    mean, p99, step = (got["measures"][m] for m in MEASURES)
    assert mean["verdict"] == "within noise" and mean["paired_at_or_below"] == 2
    assert p99["verdict"] == "worse" and p99["paired_at_or_below"] == 0
    assert p99["median_ratio"] == pytest.approx(10.0 / 8.0)  # the paired ratios 10/8, 11/9, 12/9.5
    assert step["verdict"] == "better" and step["paired_at_or_below"] == 3
    runs["b"][1]["failed"] = 7
    assert ns.compare_point(runs)["b"]["failed_calls"] is True


def test_noise_spread_runs_a_point_end_to_end(capsys):
    ns = load("noise_spread")
    assert ns.main(["--point", "mopd-skewed:16:0", "--replicas", "2", "--policies", "static-services", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (pt,) = out["points"]
    assert (pt["workload"], pt["batch"], pt["seed"], pt["replicas"]) == ("mopd-skewed", 16, 0, 2)
    assert set(pt["policies"]) == {"tangram", "static-services"}
    # replica 0 is the seed's own run, number for number
    own = simulate(load_workload("mopd-skewed").with_batch(16), "tangram", seed=0).summary
    assert pt["policies"]["tangram"]["runs"][0] == [own[m] for m in MEASURES]
    assert len(pt["policies"]["static-services"]["runs"]) == 2
    assert set(pt["against"]["static-services"]["measures"]) == set(MEASURES)


@pytest.mark.parametrize("flag, text", [
    *[("--point", t) for t in ("mopd", "mopd:x:0", "mopd:16", "mopd:0:0", "mopd:16:-1")],
    *[("--draw", t) for t in ("gpu:1", "nofamily:1:0", "gpu:x:0", "gpu:1:-1")],
])
def test_noise_spread_refuses_a_malformed_point_or_draw(flag, text, capsys):
    ns = load("noise_spread")
    with pytest.raises(SystemExit) as exc:
        ns.main([flag, text])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_noise_spread_needs_two_replicas(capsys):
    ns = load("noise_spread")
    with pytest.raises(SystemExit):
        ns.main(["--point", "mopd:16:0", "--replicas", "1"])
    assert "--replicas must be 2 or more" in capsys.readouterr().err


@pytest.mark.parametrize("books, stored", [(None, "api-adaptive-books-sim-seed-0.json"),
                                            ("conservative", "sim-seed-0.json")])
def test_noise_spread_runs_a_policy_stress_draw_whose_replica_zero_is_the_stored_run(books, stored, capsys):
    # API draw 5 (128 trajectories) is one whose results differ between the two books
    ns = load("noise_spread")
    # the stored families ran cold, before the GPU nodes' warm start was the default
    args = ["--draw", "api:5:0", "--replicas", "2", "--policies", "api-retry", "--cold-start", "--json"]
    assert ns.main(args + (["--books", books] if books else [])) == 0
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert (pt["family"], pt["draw"], pt["sim_seed"], pt["books"]) == ("api", 5, 0, books or "default")
    assert pt["warm_start"] is False
    rows = json.loads((ROOT / "docs" / "results" / "policy-stress" / stored).read_text())["workloads"]
    (row,) = [w for w in rows if w and w["family"] == "api" and w["seed"] == 5]
    assert pt["policies"]["tangram"]["runs"][0] == row["results"]["tangram"]


def test_noise_spread_names_an_unknown_workload_or_policy(capsys):
    ns = load("noise_spread")
    with pytest.raises(SystemExit) as exc:
        ns.main(["--point", "nope:16:0"])
    assert exc.value.code == 2 and "unknown workload 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ns.main(["--point", "mopd:16:0", "--policies", "fixed-dop:x"])
    assert "policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ns.main(["--point", "mopd:16:0", "--jobs", "0"])
    assert "--jobs must be 1 or more" in capsys.readouterr().err


def test_noise_spread_needs_a_point_or_a_draw(capsys):
    ns = load("noise_spread")
    with pytest.raises(SystemExit):
        ns.main([])
    assert "give at least one --point or --draw" in capsys.readouterr().err


def test_noise_spread_runs_tangram_with_a_changed_param_and_refuses_a_bad_one(capsys):
    ns = load("noise_spread")
    args = ["--point", "deepsearch:96:0", "--replicas", "2", "--policies", "api-retry", "--json"]
    assert ns.main(args + ["--param", "order=fcfs"]) == 0
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert pt["params"] == {"order": "fcfs"}
    wl = load_workload("deepsearch").with_batch(96)
    assert pt["policies"]["tangram"]["runs"][0] == [simulate(wl, "tangram:fcfs", seed=0).summary[m] for m in MEASURES]
    with pytest.raises(SystemExit):
        ns.main(args + ["--param", "aging_k=-1"])
    assert "--param: aging_k: must be a finite number >= 0" in capsys.readouterr().err
