"""Holdouts: an elastic group a round made wait in full is not searched again while its inputs
are unchanged (Plan.holdouts -> Snapshot.holdouts), and the expected arrivals' fast start."""
from __future__ import annotations

import random
from bisect import insort
from dataclasses import replace

import pytest

import tangram.policy.elastic as elastic
from tangram.policy.estimate import Arrivals, _arrive
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams, Snapshot

from tests.helpers import make_action, make_engine, make_node, one_node_snapshot


_snap = one_node_snapshot


def _reward(i=0, t1=32.0):
    return make_action(f"R{i}", cpu={"min": 1, "max": 16}, t1=t1, serial=0.0, cls="reward", trajectory=f"r{i}")


def _shell(i):
    return make_action(f"s{i}", cpu=1, t1=2.0, trajectory=f"t{i}", cls="shell")


def _decided(p):
    return sorted((d.action.id, dict(d.units)) for d in p.dispatches)


@pytest.fixture
def searches(monkeypatch):
    """How many times the eviction search ran."""
    calls = []
    real = elastic._evict

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(elastic, "_evict", counting)
    return calls


def _held():
    # 15 of 16 cores end in 0.5 s: a 32 s perfectly parallel reward waits for all 16 (ends at
    # 2.5 s) rather than start on the one free core (32 s)
    return _snap([_reward()], running=((0.5, 15),))


def test_a_group_made_to_wait_in_full_is_a_holdout():
    p = plan(_held())
    assert p.dispatches == ()
    assert set(p.holdouts) == {"cpu@n0"}
    started = plan(_snap([_reward()]))  # a free node: it starts, nothing is held out
    assert _decided(started) == [("R0", {"cpu": 16})] and not started.holdouts


def test_a_holdout_whose_inputs_did_not_change_is_not_searched_again(searches):
    snap = _held()
    first = plan(snap)
    n = len(searches)
    assert n > 0
    again = plan(replace(snap, holdouts=first.holdouts))
    assert len(searches) == n  # no search: the group waits again
    assert again.dispatches == () and dict(again.holdouts) == dict(first.holdouts)


@pytest.mark.parametrize("change", ["finished", "fixed_queued_behind", "elastic_queued_behind", "arrival", "estimate", "knobs",
                                    "capacity"])
def test_any_changed_input_re_decides_the_group(searches, change):
    snap = _held()
    holdouts = plan(snap).holdouts
    if change == "finished":  # the running action ended: all 16 cores free
        changed = _snap([_reward()])
    elif change == "fixed_queued_behind":  # a fixed action that cannot start (2 cores, 1 free) waits behind it
        changed = replace(snap, waiting=(_reward(), make_action("big", cpu=2, t1=8.0, trajectory="x")))
    elif change == "elastic_queued_behind":  # a reward that cannot start on the one free core
        changed = replace(snap, waiting=(_reward(), _reward(2, t1=1.0)))
    elif change == "arrival":
        changed = replace(snap, upcoming={"n0": ((0.0, _shell(0)),)})
    elif change == "estimate":  # an unprofiled action behind it: its class's estimate moved
        behind = (_reward(), make_action("u", cpu=2, trajectory="x", cls="build"))
        snap = replace(snap, waiting=behind, class_estimates={"build": 0.1})
        holdouts = plan(snap).holdouts
        changed = replace(snap, class_estimates={"build": 30.0})
    elif change == "knobs":
        changed = replace(snap, params=PolicyParams(depth=3))
    else:
        changed = _snap([_reward()], running=((0.5, 14),))
    assert holdouts, "the case must start from a held group"
    n = len(searches)
    got = plan(replace(changed, holdouts=holdouts))
    assert len(searches) > n  # searched again
    assert _decided(got) == _decided(plan(changed))  # and decided as with no holdout at all


def _random_snap(rng: random.Random) -> Snapshot:
    cores = rng.choice([8, 16, 32])
    running, used = [], 0
    for _ in range(rng.randint(0, 6)):
        u = rng.randint(1, 6)
        if used + u <= cores:
            running.append((rng.uniform(0.0, 20.0), u))
            used += u
    waiting = [_reward(i, t1=rng.uniform(1.0, 200.0)) for i in range(rng.randint(1, 3))]
    waiting += [_shell(i) for i in range(rng.randint(0, 3))]
    rng.shuffle(waiting)
    upcoming = {"n0": tuple((rng.uniform(0.0, 5.0), _shell(100 + i)) for i in range(rng.randint(0, 8)))}
    return _snap(waiting, cores=cores, running=tuple(running), upcoming=upcoming)


def test_at_the_same_instant_a_holdout_decides_what_the_search_decides():
    # the holdout skips only the search: with the clock where it was, a held group's plan is the
    # plan the search gives (what moves between rounds is time, which the tests above change)
    rng = random.Random(5)
    held = 0
    for _ in range(300):
        snap = _random_snap(rng)
        first = plan(snap)
        held += bool(first.holdouts)
        again = plan(replace(snap, holdouts=first.holdouts))
        assert _decided(again) == _decided(first)
        assert dict(again.holdouts) == dict(first.holdouts)
    assert held > 10  # the cases held some groups


def _unprofiled(i, cls="build"):
    return make_action(f"u{i}", cpu=1, trajectory=f"q{i}", cls=cls)


def _perturbed(rng: random.Random, limit: int, residual: bool = False):
    """A snapshot whose arrivals come from the engine's view (capped at ``limit``; ``residual``:
    under ``arrival_gap`` "residual") and whose unprofiled actions read class estimates, the same
    instant after one event changed it, and the class whose estimate the event moved (or None)."""
    from tangram.core.gaps import ResidualGaps
    from tangram.core.generating import UpcomingView

    def recent_gaps():  # a publication of 1-5 gaps, some outlasted by the quiet times below
        if not residual:
            return None
        return ResidualGaps(tuple(sorted(rng.uniform(0.2, 4.0) for _ in range(rng.randint(1, 5)))))

    base = _random_snap(rng)
    quiet = {"n0": {f"q{i}": (rng.uniform(0.0, 3.0), _unprofiled(i, rng.choice(["build", "lint"])))
                    for i in range(rng.randint(1, 4))}}
    waiting = list(base.waiting) + [_unprofiled(50 + i, "lint") for i in range(rng.randint(0, 2))]
    estimates = {"build": rng.uniform(0.1, 20.0), "lint": rng.uniform(0.1, 20.0)}
    gap, now = rng.uniform(0.5, 4.0), 3.0
    gaps = recent_gaps()
    snap = replace(base, waiting=tuple(waiting), class_estimates=estimates,
                   upcoming=UpcomingView(quiet, gap, now, limit, gaps))
    event, cls = rng.choice(["submitted", "estimate", "gap"]), None
    if event == "submitted":  # the first quiet trajectory submits: the next one comes into view
        quiet2 = {"n0": dict(list(quiet["n0"].items())[1:])}
        changed = replace(snap, upcoming=UpcomingView(quiet2, gap, now, limit, gaps))
    elif event == "estimate":
        cls = rng.choice(["build", "lint"])
        changed = replace(snap, class_estimates={**estimates, cls: rng.uniform(0.1, 20.0)})
    else:  # a submission elsewhere moved the mean generation gap (or republished the recent gaps)
        changed = replace(snap, upcoming=UpcomingView(quiet, rng.uniform(0.5, 4.0), now, limit, recent_gaps()))
    return snap, changed, cls


@pytest.mark.parametrize("residual", [False, True], ids=["mean-gap", "residual-gap"])
@pytest.mark.parametrize("limit", [1, 2, 32])
def test_after_an_event_at_the_same_instant_a_holdout_decides_what_the_search_decides(limit, residual):
    # an event that changes what the search reads without a release (a quiet trajectory submitting
    # while the look-ahead shows only ``limit`` of them, a class estimate, the mean gap) must not
    # leave a group held out that the search would now start
    rng = random.Random(limit)
    held = 0
    for _ in range(1500):
        snap, changed, cls = _perturbed(rng, limit, residual)
        first = plan(snap)
        if residual and cls is not None and any(d.action.t1_s is None and d.action.action_class == cls
                                                for d in first.dispatches):
            # a candidate of the first round reads the moved estimate: in the engine it is running
            # by the next round, for the time its dispatch estimated (what the holdout's inputs
            # keep: _holdout_inputs), while this same-instant snapshot still has it waiting. The
            # mean-gap draws keep every case (none of them meets one); the residual ones do
            continue
        holdouts = first.holdouts
        held += bool(holdouts)
        assert _decided(plan(replace(changed, holdouts=holdouts))) == _decided(plan(changed))
    assert held > 100


def _arrive_one_by_one(ends, free, arrivals):
    """The expected arrivals' walk, one insertion each (the reference)."""
    total, k, now, size = 0.0, 0, 0.0, len(ends)
    for r, units, d in arrivals:
        while free < units:
            if k == size:
                free = units
                break
            t, u = ends[k]
            k += 1
            free += u
            now = max(now, t)
        end = (now if now > r else r) + d
        total += end - r
        insort(ends, (end, units), k)
        size += 1
        free -= units
    return total, k, free, now


def test_arrivals_that_fit_from_the_start_are_taken_at_once_with_the_same_result():
    rng = random.Random(11)
    for _ in range(2000):
        ends = sorted((round(rng.uniform(0.0, 10.0), rng.choice([0, 1, 3])), rng.randint(1, 4))
                      for _ in range(rng.randint(0, 12)))
        arrivals = [(round(rng.uniform(0.0, 6.0), rng.choice([0, 1])), rng.randint(1, 3), rng.uniform(0.1, 4.0))
                    for _ in range(rng.randint(0, 10))]
        arrivals.sort(key=lambda x: x[0])
        free = rng.randint(-1, 20)
        expect_ends, got_ends = list(ends), list(ends)
        expect = _arrive_one_by_one(expect_ends, free, arrivals)
        got = _arrive(got_ends, free, Arrivals(arrivals))
        assert got == expect and got_ends == expect_ends
        assert _arrive(list(ends), free, arrivals) == expect  # a plain list is prepared on the way


def test_engine_hands_holdouts_back_and_a_tick_re_decides_them(searches):
    eng, clock = make_engine(make_node("n0", cores=16), api={"llm": 4})
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    assert not eng.submit(_reward())  # waits for all 16 cores
    n = len(searches)
    # an API call of another trajectory: a round that starts it, the reward's group not searched
    started = eng.submit(make_action("call", api="llm", t1=1.0))
    assert [s.action.id for s in started] == ["call"] and len(searches) == n
    eng.tick()
    assert len(searches) > n
    clock.advance(0.5)
    started = eng.complete("busy")  # its cores free: searched again, and it starts on all 16
    assert [(s.action.id, s.dispatch.units["cpu"]) for s in started] == [("R0", 16)]


def test_the_floor_is_under_every_estimate():
    # the headroom search skips an arrangement whose own objective plus this floor cannot win: the
    # floor must be under the estimate whatever the completions, units, waiters and arrivals
    from tangram.policy.estimate import estimate_sorted, floor

    rng = random.Random(3)
    tight = 0
    for _ in range(3000):
        ends = sorted((rng.uniform(0.0, 10.0), rng.randint(1, 4)) for _ in range(rng.randint(0, 10)))
        waiters = []
        for _ in range(rng.randint(0, 5)):
            umin = rng.randint(1, 3)
            options = None
            if rng.random() < 0.5:
                units = sorted(rng.sample(range(umin, umin + 8), rng.randint(1, 4)))
                options = tuple((u, rng.uniform(0.05, 9.0) / u) for u in units)
            waiters.append((umin, rng.uniform(0.05, 5.0), options))
        arrivals = sorted((rng.choice([0.0, rng.uniform(0.0, 4.0)]), rng.randint(1, 3), rng.uniform(0.1, 3.0))
                          for _ in range(rng.randint(0, 6)))
        free = rng.randint(0, 12)
        lower = floor(waiters, Arrivals(arrivals))
        got = estimate_sorted(list(ends), free, waiters, rng.randint(0, 2), Arrivals(arrivals) if arrivals else ())
        assert lower <= got
        tight += got - lower < 1e-6 * max(1.0, got)
    assert tight > 50  # the bound is reached (nothing waits): a floor that is too low would not show here


def test_other_candidates_are_read_for_as_long_as_their_dispatches_say():
    # G (a GPU and a core, its model not resident: a 30 s restore before its 1 s run) is the
    # reward's other candidate on the node's cores. Read as the 1 s run, the reward would hold out
    # for G's core; next round, at the same instant, G is running for 31 s and the search would
    # start the reward: a holdout on equal inputs would not.
    from tangram.core.engine import Engine
    from tangram.core.model import Action
    from tangram.managers.base import CountingManager
    from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
    from tests.helpers import FakeClock

    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 16, "mem@n0": 10_000, "api:llm": 4}),
                  GpuManager([GpuNode("n0", 1, 100)], [ModelSpec("rm", 60)])],
                 clock=clock, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("busyA", cpu=8, t1=0.6, trajectory="a"))
    eng.submit(make_action("busyB", cpu=8, t1=0.1, trajectory="b"))
    eng.submit(Action.build("G", {"gpu": 1, "cpu": 1}, service="rm", t1_s=1.0, restore_s={1: 30.0}, action_class="g"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=20.0, serial=0.0, cls="reward", trajectory="r"))
    clock.advance(0.1)
    started = eng.complete("busyB")
    assert {s.action.id: s.dispatch.estimated_s for s in started}["G"] == pytest.approx(31.0)
    eng.submit(make_action("call", api="llm", t1=1.0))  # another round at the same instant
    snap = eng.snapshot()
    assert _decided(plan(replace(snap, holdouts={}))) == []  # nothing the search would start is left


def test_a_group_whose_other_candidate_a_later_group_resized_is_not_held():
    # X takes a core of the node and is elastic on API slots: R0's group reads it at its minimum
    # API slots (2 s), then the API group gives it more (a shorter run). Next round X runs for that
    # shorter time, which R0's decision did not read: R0's group must be re-decided, not held.
    from tangram.core.model import Action, Elasticity
    from tangram.core.records import ActionRecord

    eng, clock = make_engine(make_node("n0", cores=16), params=PolicyParams(order="fcfs"), api={"llm": 9})
    eng.place_trajectory("r", "n0", 0)
    eng.place_trajectory("b", "n0", 0)
    eng.submit(make_action("busy", cpu=14, t1=1.0, trajectory="b"))
    X = Action.build("X", {"cpu": 1, "api:llm": {"min": 1, "max": 8}}, t1_s=16.0,
                     elasticity=Elasticity.amdahl(0.0), action_class="x")
    R0 = make_action("R0", cpu={"min": 1, "max": 16}, t1=8.0, serial=0.0, cls="reward", trajectory="r")
    for a in (R0, X):  # queued together: one round sees both, R0's group first
        eng._enqueue(ActionRecord(a, submitted_at=clock()))
    eng.schedule()
    assert eng.running["X"].dispatch.units["api:llm"] > 1  # the API group resized X
    assert "R0" in eng.running or "cpu@n0" not in eng.snapshot().holdouts
    eng.submit(make_action("Y", cpu=1, t1=1.0))  # another round at the same instant
    assert _decided(plan(replace(eng.snapshot(), holdouts={}))) == []
