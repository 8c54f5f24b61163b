"""Restarting a straggler wider (tangram.policy.restart, tangram.core.restarts): the expected time
left under the class's lognormal, the decision, the engine's bookkeeping, the simulator's and a real
process's restart."""
from __future__ import annotations

import asyncio
import math
import os
import random
from pathlib import Path
from statistics import NormalDist

import pytest

from tangram.core.engine import Engine
from tangram.core.estimator import CV_AFTER, DurationEstimator
from tangram.core.model import Action, Elasticity, Profile
from tangram.core import restarts
from tangram.executors.local import LocalExecutor
from tangram.managers.base import AllocationError, CountingManager
from tangram.managers.cpu import CpuManager, CpuNode
from tangram.policy.restart import expected_beyond, restart_dop
from tangram.policy.snapshot import PolicyParams
from tangram.runtime import Runtime
from tangram.scaleout.gate import DownNodes, NodeGate
from tangram.service.config import ConfigError, parse_config
from tangram.service.metrics import ServiceMetrics
from tangram.simulator.sim import simulate
from tangram.simulator.workload import parse_workload

from tests.helpers import FakeClock, make_action, make_engine, make_node

SUITE = Elasticity.amdahl(0.05)


def _lognormal_beyond(mean: float, cv: float, x: float, steps: int = 200_000) -> float:
    """E[T | T > x] by integrating the lognormal's density in log space (midpoint rule)."""
    s2 = math.log1p(cv * cv)
    s = math.sqrt(s2)
    mu = math.log(mean) - s2 / 2
    lo, hi = math.log(x), max(math.log(x), mu) + 14 * s
    h = (hi - lo) / steps
    num = den = 0.0
    for i in range(steps):
        y = lo + (i + 0.5) * h
        w = math.exp(-0.5 * ((y - mu) / s) ** 2)
        num += w * math.exp(y)
        den += w
    return num / den


@pytest.mark.parametrize("mean,cv,x", [(120.0, 1.0, 50.0), (120.0, 1.0, 400.0), (300.0, 0.5, 900.0),
                                       (10.0, 2.0, 200.0), (60.0, 0.3, 30.0),
                                       (1.0, 1.0, 2000.0), (1.0, 0.3, 60.0)])  # the last: past z = 30
def test_the_expected_run_beyond_x_is_the_lognormals(mean, cv, x):
    assert expected_beyond(mean, cv, x) == pytest.approx(_lognormal_beyond(mean, cv, x), rel=2e-3)


def test_the_expected_run_beyond_x_is_the_mean_before_it_starts_and_grows_past_x():
    assert expected_beyond(120.0, 1.0, 0.0) == 120.0
    assert expected_beyond(120.0, 0.0, 60.0) == 120.0  # no spread: every run is the mean
    assert expected_beyond(120.0, 0.0, 130.0) is None  # ... and none is longer
    rng = random.Random(1)
    for _ in range(200):
        mean, cv, x = rng.uniform(1, 500), rng.uniform(0.05, 3), rng.uniform(0.01, 5000)
        e = expected_beyond(mean, cv, x)
        assert e is not None and e > x and math.isfinite(e)


def _decide(**kw):
    args = dict(mean_t1=100.0, cv=1.0, speedup=lambda m: SUITE.efficiency(m) * m, dop=1, elapsed_s=300.0,
                options=[2, 4, 8], gain=0.8)
    return restart_dop(**(args | kw))


def test_a_long_run_of_a_heavy_tailed_class_is_restarted_at_the_widest_dop():
    assert _decide() == 8
    # at 300 s of a 100 s class it has done 300 T1-seconds: expected 400+ more at one core, ~90 s at 8
    assert _decide(options=[2]) is None  # 2 cores cannot halve... 0.8 of its time left from the start again


def test_what_leaves_a_run_where_it_is():
    assert _decide(gain=0.0) is None  # restarts off
    assert _decide(options=[]) is None  # no wider DoP free
    assert _decide(dop=8, options=[8]) is None
    assert _decide(cv=0.2) is None  # a narrow class: a run past its mean is nearly done
    assert _decide(cv=0.0) is None  # past the one value of a class without spread
    # just started: nothing is lost, and 8 cores are faster (a round would have widened it had it had them)
    assert _decide(elapsed_s=0.0) == 8


def _seed_spread(est: DurationEstimator, cls: str, n: int, mean: float = 100.0, cv: float = 1.0) -> None:
    """``n`` ended runs of ``cls`` at one core, their T1 the quantiles of a lognormal of this mean and cv."""
    s = math.sqrt(math.log1p(cv * cv))
    for i in range(n):
        a = Action.build(f"seed{i}", {"cpu": {"min": 1, "max": 8}}, action_class=cls, t1_s=mean, elasticity=SUITE)
        est.observe(a, 1, math.exp(math.log(mean) - s * s / 2 + s * NormalDist().inv_cdf((i + 0.5) / n)))


def _suite(id: str, *, restartable: bool = True, trajectory: str = "t0") -> Action:
    return Action.build(id, {"cpu": {"min": 1, "max": 8}}, action_class="suite", t1_s=100.0, elasticity=SUITE,
                        trajectory=trajectory, restartable=restartable)


def _straggler(params=None, *, restartable=True, runs=CV_AFTER, wide_trajectory=None, suite_trajectory="t0"):
    """A node of 8 cores: a fixed action holds 7 for 1,000 s, so the suite starts on the one left."""
    eng, clock = make_engine(make_node(cores=8), params=params)
    _seed_spread(eng.estimator, "suite", runs)
    eng.submit(make_action("wide", cpu=7, t1=1000.0, trajectory=wide_trajectory))
    [s] = eng.submit(_suite("s", restartable=restartable, trajectory=suite_trajectory))
    assert s.dispatch.dop == 1
    clock.advance(300.0)
    return eng, clock


def test_the_engine_restarts_a_straggler_on_the_cores_a_completion_frees():
    eng, clock = _straggler()
    out = eng.complete("wide")
    [s] = [x for x in out if x.action.id == "s"]
    assert s.restart and s.dispatch.dop == 8
    rec = eng.running["s"]
    assert rec.started_at == clock() and rec.restarted_s == pytest.approx(300.0)
    assert eng.runs_restarted == 1
    assert eng.pool_states()["cpu@n0"].free == 0
    eng.check_invariants()
    clock.advance(20.0)
    eng.complete("s")
    done = eng.finished["s"]
    assert done.queued_s == pytest.approx(0.0)  # the stopped run is not queueing
    assert done.exec_s == pytest.approx(20.0)  # the run that ended
    assert done.act_s == pytest.approx(320.0)
    assert eng.pool_states()["cpu@n0"].free == 8


def test_without_expected_arrivals_a_restart_takes_what_a_quiet_trajectory_would_ask_for():
    # t1 goes quiet when its 7-core "wide" ends; under expect_arrivals its next action is expected to
    # ask for 7 (below: nothing restarts); without, the 7 cores are idle
    eng, _ = _straggler(PolicyParams(expect_arrivals=False), wide_trajectory="t1")
    [s] = [x for x in eng.complete("wide") if x.action.id == "s"]
    assert s.restart and s.dispatch.dop == 8


def test_a_restart_keeps_the_classs_dop_cap():
    eng, _ = _straggler(PolicyParams(dop_caps={"suite": 6}))
    [s] = [x for x in eng.complete("wide") if x.action.id == "s"]
    assert s.restart and s.dispatch.dop == 6  # of the 8 free


@pytest.mark.parametrize("case", ["not restartable", "off", "too few runs seen", "wanted by the queue",
                                  "the fixed-DoP baseline", "a one-shot environment", "a failed completion",
                                  "the units expected back", "a cancel on its way"])
def test_what_keeps_the_engine_from_restarting(case):
    params = {"off": PolicyParams(restart_gain=0.0), "the fixed-DoP baseline": PolicyParams(fixed_dop=1)}.get(case)
    eng, clock = _straggler(params, restartable=case != "not restartable",
                            runs=CV_AFTER - 1 if case == "too few runs seen" else CV_AFTER,
                            suite_trajectory=None if case == "a one-shot environment" else "t0",
                            wide_trajectory="t1" if case == "the units expected back" else None)
    if case == "wanted by the queue":  # a fixed action of 8 cores waits for the node: the cores are its
        eng.submit(make_action("next", cpu=8, t1=10.0, trajectory="t2"))
    if case == "a cancel on its way":  # the driver is killing its run (Runtime.cancel)
        eng.books.withdraw("s")
    out = eng.complete("wide", "failed" if case == "a failed completion" else "succeeded")
    assert not any(x.restart for x in out)
    assert eng.runs_restarted == 0 and eng.running["s"].dispatch.dop == 1
    eng.check_invariants()


def test_restart_gain_is_validated_and_read_from_the_config():
    with pytest.raises(ValueError, match="restart_gain"):
        PolicyParams(restart_gain=1.5)
    with pytest.raises(ValueError, match="restart_gain"):
        PolicyParams(restart_gain=True)
    with pytest.raises(ConfigError) as e:
        parse_config({"scheduler": {"restart_gain": 2}})
    assert e.value.field == "scheduler.restart_gain"
    assert parse_config({"scheduler": {"restart_gain": 0.5}}).restart_gain == 0.5
    with pytest.raises(Exception) as e:
        Action.build("a", {"cpu": 1}, restartable="yes")
    assert e.value.field == "restartable"


def _heavy_tailed_workload(restartable: bool) -> dict:
    return {
        "name": "suites", "trajectories": 96, "turns": {"dist": "lognormal", "mean": 3, "cv": 0.5, "min": 1},
        "generation_s": {"dist": "lognormal", "mean": 1.0, "cv": 0.8}, "memory_mb": 1024,
        "actions": {"shell": {"duration_s": {"dist": "lognormal", "mean": 1.0, "cv": 1.5},
                              "resources": {"cpu": 1}}},
        "rewards": {"test-suite": {"duration_s": {"dist": "lognormal", "mean": 60.0, "cv": 1.5, "max": 3600},
                                   "resources": {"cpu": {"min": 1, "max": 16}}, "elasticity": {"amdahl": 0.05},
                                   "profiled": True, "restartable": restartable}},
        "cluster": {"cpu_nodes": 2, "cores_per_node": 16, "mem_gb_per_node": 1024},
    }


def test_the_simulator_restarts_stragglers_and_keeps_its_books():
    runs = {r: simulate(parse_workload(_heavy_tailed_workload(r)), "tangram", seed=2, check=True) for r in (False, True)}
    assert runs[False].summary["restarts"] == 0
    res = runs[True]
    assert res.summary["restarts"] > 0
    restarted = [r for r in res.records if r.restarts]
    assert restarted and all(r.units > 1 and r.run_from > r.start for r in restarted)
    for r in restarted:  # the run that counts is its last, whole, at its last DoP (after its environment's start)
        assert r.end == pytest.approx(max(r.run_from, r.start + r.setup_s) + r.run_s)
    # every second of a trajectory is still its generation or its actions
    trajs = {id(r.traj): r.traj for r in res.records}
    generation = sum(i.gen_s for t in trajs.values() for i in t.items)
    assert sum(r.end - r.submit for r in res.records) == pytest.approx(sum(t.end for t in trajs.values()) - generation)
    # the stopped runs' core-seconds are counted busy: busy never exceeds what was reserved
    cpu = res.summary["pools"]["cpu"]
    assert 0 < cpu["busy_unit_s"] <= cpu["reserved_unit_s"] + 1e-6


def test_a_restart_with_a_restartable_field_is_refused_on_other_kinds_and_mistyped():
    from tangram.core.errors import DemandError
    from tangram.service.wire import parse_action

    assert parse_action({"kind": "exec", "command": "true", "restartable": True})["restartable"] is True
    for body, field in [({"kind": "exec", "command": "true", "restartable": 1}, "restartable"),
                        ({"kind": "http", "url": "http://x", "restartable": True}, "restartable")]:
        with pytest.raises(DemandError) as e:
            parse_action(body)
        assert e.value.field == field


def _one_node_runtime(tmp_path: Path, kill_grace_s: float) -> tuple[Engine, Runtime]:
    """A node of 4 cores run by a local executor. The suite's class: 2 s at one core with cv 1 (its
    profile and, once _blocker_and_suite seeds them, its runs); the blocker is profiled long, so the
    suite starts at once on the one core it leaves rather than wait for the others."""
    ex = LocalExecutor(str(tmp_path / "envs"), kill_grace_s=kill_grace_s, sandbox="none")
    eng = Engine([CountingManager({"cpu@n0": 4, "mem@n0": 10_000})])
    profiles = {"suite": Profile(t1_s=2.0, elasticity=SUITE), "blocker": Profile(t1_s=100.0)}
    return eng, Runtime(eng, env_executors={"n0": ex}, profiles=profiles)


async def _blocker_and_suite(rt: Runtime, command: str, timeout_s: float | None = None) -> tuple[str, str]:
    """A 1.5 s blocker on 3 cores and a restartable suite running ``command`` in an environment: it
    starts on the core left and is restarted at 4 as the blocker ends."""
    _seed_spread(rt.engine.estimator, "suite", CV_AFTER, mean=2.0)
    env = await rt.create_environment(memory_mb=100)
    blocker = rt.submit(rt.build_action("exec", {"cpu": 3}, environment=None, profile="blocker", command="sleep 1.5"))
    suite = rt.submit(rt.build_action("exec", {"cpu": {"min": 1, "max": 4}}, environment=env, profile="suite",
                                      restartable=True, timeout_s=timeout_s, command=command))
    return blocker, suite


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["finish", "cancel", "close"])
async def test_a_real_process_is_stopped_and_run_again_wider(tmp_path: Path, then):
    """A real local process: the straggler's first run is killed before its second begins in the same
    environment, the second runs at the wider DoP (or is cancelled, or shut down, as a first run would
    be), and nothing is left running or held."""
    eng, rt = _one_node_runtime(tmp_path, kill_grace_s=0.2)
    metrics = ServiceMetrics(rt)
    loop = asyncio.get_running_loop()
    log = tmp_path / "runs.log"
    async with rt:
        blocker, suite = await _blocker_and_suite(
            rt, f'echo start $TANGRAM_DOP >> {log}; sleep $((4 / TANGRAM_DOP)); echo end $TANGRAM_DOP >> {log}')
        t0 = loop.time()
        assert (await rt.wait(blocker)).status == "succeeded"
        assert eng.runs_restarted == 1 and rt.stats()["restarts"] == 1  # restarted as the blocker ended
        if then == "finish":
            out = await rt.wait(suite)
            assert out.status == "succeeded" and out.timing.exec_s < 3.0 and out.allocation["restarted_s"] > 0
            assert "tangram_runs_restarted_total 1.0" in metrics.render()[0].decode()
        elif then == "cancel":
            await asyncio.sleep(0.3)  # the wider run has begun
            assert rt.cancel(suite)
            assert (await rt.wait(suite)).status == "cancelled"
    if then == "close":
        assert rt.result(suite).status == "cancelled"
    # past the end of either run had it not been killed (4 s at one core)
    await asyncio.sleep(max(0.0, t0 + 5.0 - loop.time()))
    lines = log.read_text().split("\n")[:-1]
    assert lines == (["start 1", "start 4", "end 4"] if then == "finish" else ["start 1", "start 4"])[:len(lines)]
    assert lines[0] == "start 1" and ("end 4" in lines) == (then == "finish")
    metrics.close()
    rt.check_whole()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["cancel at once", "deadline"])
async def test_a_restarted_run_waits_for_the_old_process_and_keeps_the_deadline(tmp_path: Path, then):
    """A cancel as the straggler is restarted ends the action only once its old process is dead (it
    ignores SIGTERM: killed after the grace); a restart does not move the action's deadline."""
    eng, rt = _one_node_runtime(tmp_path, kill_grace_s=0.3)
    loop = asyncio.get_running_loop()
    log = tmp_path / "runs.log"
    async with rt:
        blocker, suite = await _blocker_and_suite(
            rt, f"trap '' TERM; echo start $TANGRAM_DOP $$ >> {log}; sleep $((8 / TANGRAM_DOP)); echo end >> {log}",
            timeout_s=3.0 if then == "deadline" else None)
        t0 = loop.time()
        assert (await rt.wait(blocker)).status == "succeeded" and eng.runs_restarted == 1
        if then == "cancel at once":
            assert rt.cancel(suite)
            assert (await rt.wait(suite)).status == "cancelled"
            old_pid = int(log.read_text().split()[2])
            with pytest.raises(ProcessLookupError):  # gone before the action ended (and its cores went back)
                os.kill(old_pid, 0)
            assert log.read_text().split()[:2] == ["start", "1"]  # the wider run never began
        else:  # 1.5 s were spent at DoP 1: the run at 4 (2 s) has 1.5 s left, not 3
            out = await rt.wait(suite)
            assert out.status == "timeout" and loop.time() - t0 < 4.0
            # the result says the deadline was partly the stopped run's: a client may run it again whole
            assert out.allocation["restarted_s"] >= 1.0 and out.allocation["dop"] == 4, out.allocation
            assert "end" not in log.read_text()
    rt.check_whole()


def test_the_units_expected_back_are_kept_as_trajectories_come_and_go():
    from tangram.core.generating import Generating

    gen, rng = Generating(), random.Random(5)
    actions = {n: make_action(f"a{n}", cpu=n, trajectory="x") for n in (1, 2, 4)}
    suite = _suite("s", trajectory="x")  # elastic: a trajectory whose last action was it is not counted
    live: dict[str, str] = {}  # trajectory -> node
    for step in range(2000):
        t = f"t{rng.randrange(40)}"
        if t in live and rng.random() < 0.1:
            gen.closed(t)
            del live[t]
            continue
        live.setdefault(t, f"n{rng.randrange(3)}")
        a = rng.choice([*actions.values(), suite])
        gen.submitted(Action.build(f"{t}/{step}", a.demands, trajectory=t, t1_s=a.t1_s, elasticity=a.elasticity),
                      float(step))
        gen.ended(Action.build(f"{t}/{step}", a.demands, trajectory=t, t1_s=a.t1_s, elasticity=a.elasticity),
                  live[t], float(step) + 0.5)
        want = {}
        for node, quiet in gen._fixed.items():
            units = sum(x.demands["cpu"].min for _, x in quiet.values())
            if units:
                want[node] = units
        assert dict(gen.expected_cpu()) == want


def test_a_regrant_keeps_the_cores_held_and_adds_free_ones():
    """The cores a restarted run holds stay its own (its old process dies on them): widening adds free
    ones, preferring its NUMA domain; narrowing keeps a subset; a refusal changes nothing."""
    m = CpuManager(CpuNode("n0", cores=tuple(range(8)), numa=((0, 1, 2, 3), (4, 5, 6, 7)), memory_mb=1000))
    m.allocate("cpu@n0", 4, "a")  # best fit: one whole domain
    held = m.allocate("cpu@n0", 2, "s")
    m.allocate("cpu@n0", 1, "b")
    wider = m.regrant("cpu@n0", 3, "s", 2)
    assert set(held) < set(wider) and len(wider) == 3
    assert set(wider) <= ({4, 5, 6, 7} if held[0] >= 4 else {0, 1, 2, 3})  # its own domain had one free
    m.check_invariants()
    narrower = m.regrant("cpu@n0", 1, "s", 3)
    assert set(narrower) <= set(wider) and len(narrower) == 1
    before = (dict(m.held()["cpu@n0"]), next(p.free for p in m.pool_states() if p.name == "cpu@n0"))
    with pytest.raises(AllocationError):
        m.regrant("cpu@n0", 6, "s", 1)  # 3 free
    assert (dict(m.held()["cpu@n0"]), next(p.free for p in m.pool_states() if p.name == "cpu@n0")) == before
    m.check_invariants()
    # behind the node gate: the same, and refused on a node that is down
    down = DownNodes()
    gate = NodeGate(m, down)
    assert set(narrower) <= set(gate.regrant("cpu@n0", 2, "s", 1))
    down.mark_down("n0")
    with pytest.raises(AllocationError, match="down"):
        gate.regrant("cpu@n0", 3, "s", 2)


def test_regrants_at_random_give_exactly_the_units_asked_and_keep_the_books():
    rng = random.Random(3)
    m = CpuManager(CpuNode("n0", cores=tuple(range(16)), numa=(tuple(range(0, 16, 2)), tuple(range(1, 16, 2))),
                           memory_mb=1000))
    held: dict[str, tuple[int, ...]] = {}
    for step in range(3000):
        free = next(p.free for p in m.pool_states() if p.name == "cpu@n0")
        h = rng.choice(sorted(held)) if held else None
        if h is not None and rng.random() < 0.5:
            units = rng.randint(1, len(held[h]) + free)
            new = m.regrant("cpu@n0", units, h, len(held[h]))
            assert len(new) == units and (set(held[h]) <= set(new) if units >= len(held[h]) else set(new) < set(held[h]))
            held[h] = new
        elif h is not None and rng.random() < 0.4:
            m.release("cpu@n0", h)
            del held[h]
        elif free:
            held[f"h{step}"] = m.allocate("cpu@n0", rng.randint(1, free), f"h{step}")
        m.check_invariants()


def test_a_restartable_run_on_a_node_marked_down_is_left_to_the_node_gate():
    """The gate hides a down node's pools: a completion elsewhere looks past its restartable runs (it
    once looked their pool up and raised, losing the round's starts)."""
    down = DownNodes()
    eng = Engine([NodeGate(CountingManager({"cpu@n0": 8, "mem@n0": 1000, "cpu@n1": 8, "mem@n1": 1000}), down)],
                 clock=(clock := FakeClock()))
    _seed_spread(eng.estimator, "suite", CV_AFTER)
    [other] = eng.submit(make_action("other", cpu=8, t1=10.0, trajectory="o"))  # fills one node
    eng.submit(make_action("wide", cpu=7, t1=1000.0, trajectory="w"))  # and 7 cores of the other
    [s] = eng.submit(_suite("s"))
    assert s.dispatch.node != other.dispatch.node and s.dispatch.dop == 1
    clock.advance(300.0)
    down.mark_down(s.dispatch.node)
    assert not any(x.restart for x in eng.complete("other"))
    assert eng.running["s"].dispatch.dop == 1


def test_a_counted_regrant_moves_the_count_or_nothing():
    m = CountingManager({"cpu@n0": 8})
    m.allocate("cpu@n0", 5, "a")
    m.allocate("cpu@n0", 1, "s")
    assert m.regrant("cpu@n0", 3, "s", 1) == 3
    with pytest.raises(AllocationError):
        m.regrant("cpu@n0", 5, "s", 3)  # 0 free
    assert m.held()["cpu@n0"] == {"a": 5, "s": 3}
    m.check_invariants()


def test_the_engine_restarts_a_run_on_the_cores_it_holds():
    node = CpuNode("n0", cores=tuple(range(8)), numa=((0, 1, 2, 3), (4, 5, 6, 7)), memory_mb=10_000)
    clock = FakeClock()
    eng = Engine([CpuManager(node)], clock=clock)
    _seed_spread(eng.estimator, "suite", CV_AFTER)
    eng.submit(make_action("wide", cpu=7, t1=1000.0))
    [s] = eng.submit(Action.build("s", {"cpu": {"min": 1, "max": 6}}, action_class="suite", t1_s=100.0,
                                  elasticity=SUITE, trajectory="t0", restartable=True))
    old = s.grants["cpu@n0"]
    clock.advance(300.0)
    [r] = [x for x in eng.complete("wide") if x.action.id == "s"]
    new = r.grants["cpu@n0"]
    assert r.restart and len(new) == r.dispatch.dop > 1 and set(old) < set(new)
    eng.check_invariants()


@pytest.mark.parametrize("where", ["nowhere", "the decision", "the manager's regrant"])
def test_a_bug_in_the_restart_path_leaves_the_run_and_the_completion_as_they_were(where, monkeypatch):
    """A restart is an optimisation: an exception in it is logged, the run goes on as it was, and the
    completion returns its round's starts (raising would lose them, their grants held). "nowhere": the
    same set-up restarts the run."""
    eng, clock = _straggler()
    eng.submit(make_action("next", cpu=3, t1=10.0))  # waits for the wide action's cores, and leaves 4
    if where == "the decision":
        monkeypatch.setattr(restarts, "straggler_restarts", lambda *a, **k: 1 / 0)
    elif where == "the manager's regrant":
        monkeypatch.setattr(CountingManager, "regrant", lambda *a, **k: 1 / 0)
    out = eng.complete("wide")
    assert [(x.action.id, x.restart) for x in out] == [("next", False)] + [("s", True)] * (where == "nowhere")
    assert eng.runs_restarted == (where == "nowhere") and eng.running["s"].dispatch.dop == (5 if where == "nowhere" else 1)
    eng.check_invariants()
