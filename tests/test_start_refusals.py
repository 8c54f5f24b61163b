"""A start the policy planned that a resource manager refuses (or that raises) loses nothing else.

A round can start several actions. Before, the first refusal raised out of the round: the actions it
had started already held their grants, but their ``Started`` never reached the driver, so their
units stayed held and their clients waited for good (the driver logs a failed completion's round and
drives on). Now the refused action is left waiting, holding nothing, the refusal is logged and
counted (``Engine.starts_refused``, ``/v1/stats`` and ``tangram_starts_refused_total``), and the
round's other starts stand.
"""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from tangram.core.engine import START_RETRY_S, Engine
from tangram.executors.local import LocalExecutor
from tangram.managers.base import AllocationError, CountingManager
from tangram.policy.snapshot import Dispatch
from tangram.runtime import Runtime
from tangram.service.metrics import ServiceMetrics

from tests.helpers import FakeClock, make_action


class RefusingManager(CountingManager):
    """Counts, and refuses to allocate to a holder in ``refuse``: raises ``refuse[holder][0]`` the next
    ``refuse[holder][1]`` times it is asked."""

    def __init__(self, capacities):
        super().__init__(capacities)
        self.refuse: dict[str, tuple[Exception, int]] = {}

    def allocate(self, pool, units, holder, action=None):
        if holder in self.refuse:
            error, times = self.refuse.pop(holder)
            if times > 1:
                self.refuse[holder] = (error, times - 1)
            raise error
        return super().allocate(pool, units, holder, action)


def _engine(cores: int) -> tuple[Engine, RefusingManager, FakeClock]:
    mgr = RefusingManager({"cpu@n0": cores, "mem@n0": 10_000})
    clock = FakeClock()
    return Engine([mgr], clock=clock), mgr, clock


@pytest.mark.parametrize("error", [AllocationError("cpu@n0: refused for the test"),
                                   RuntimeError("a manager's bug")], ids=["refusal", "bug"])
def test_one_refused_start_leaves_the_rounds_other_starts_standing(error):
    eng, mgr, clock = _engine(cores=3)
    assert [s.action.id for s in eng.submit(make_action("x", cpu=3))] == ["x"]
    for aid in ("a", "b", "c"):
        assert eng.submit(make_action(aid, cpu=1)) == []
    mgr.refuse["b"] = (error, 1)
    clock.advance(1.0)
    started = eng.complete("x")  # one round plans a, b and c; the manager refuses b
    assert sorted(s.action.id for s in started) == ["a", "c"]
    assert set(eng.running) == {"a", "c"} and set(eng.waiting) == {"b"}
    assert eng.starts_refused == 1
    assert "b" not in mgr.held()["cpu@n0"] and set(mgr.held()["cpu@n0"]) == {"a", "c"}
    eng.check_invariants()
    clock.advance(1.0)
    assert [s.action.id for s in eng.complete("a")] == ["b"]  # retried at the next event
    for aid in ("b", "c"):
        eng.complete(aid)
    assert not eng.waiting and not eng.running and not any(mgr.held().values())
    eng.check_invariants()


def test_a_refused_start_on_submit_keeps_the_action_queued_and_the_submit_succeeds():
    eng, mgr, _ = _engine(cores=2)
    mgr.refuse["a"] = (AllocationError("cpu@n0: refused for the test"), 1)
    assert eng.submit(make_action("a", cpu=1)) == []  # not raised: the caller's submit stands
    assert set(eng.waiting) == {"a"} and eng.starts_refused == 1
    assert [s.action.id for s in eng.submit(make_action("b", cpu=1))] == ["a", "b"]


def test_a_dispatch_of_an_action_that_is_not_waiting_starts_nothing_and_is_counted():
    """A policy bug (it dispatched an action the engine does not hold as waiting) starts nothing."""
    eng, mgr, _ = _engine(cores=2)
    real = eng.policy

    def policy(snap):
        plan = real(snap)
        ghost = Dispatch(make_action("ghost", cpu=1), "n0", {"cpu": 1}, {"cpu": "cpu@n0"})
        return dataclasses.replace(plan, dispatches=(ghost,) + plan.dispatches)

    eng.policy = policy
    assert [s.action.id for s in eng.submit(make_action("a", cpu=1))] == ["a"]
    assert eng.starts_refused == 1 and "ghost" not in eng.running
    assert set(mgr.held()["cpu@n0"]) == {"a"}
    eng.check_invariants()


@pytest.mark.timeout(60)
async def test_a_refused_start_loses_no_real_run_and_no_client_waits_for_ever(tmp_path: Path):
    """Real processes: three waiting commands, one round for all of them after a blocker ends, one
    refused once. Every client gets its result, the counter shows the refusal, nothing stays held."""
    mgr = RefusingManager({"cpu@n0": 3, "mem@n0": 10_000})
    rt = Runtime(Engine([mgr]), env_executors={"n0": LocalExecutor(str(tmp_path / "envs"), sandbox="none")})
    metrics = ServiceMetrics(rt)
    try:
        blocker = rt.submit(rt.build_action("exec", {"cpu": 3}, environment=None, command="sleep 0.5"))
        ids = [rt.submit(rt.build_action("exec", {"cpu": 1}, environment=None, command=f"echo run-{i}"))
               for i in range(3)]
        mgr.refuse[ids[1]] = (AllocationError("cpu@n0: refused once for the test"), 1)
        outcomes = await asyncio.wait_for(asyncio.gather(rt.wait(blocker), *(rt.wait(i) for i in ids)), 30)
        assert [o.status for o in outcomes] == ["succeeded"] * 4
        assert [o.stdout.strip() for o in outcomes[1:]] == ["run-0", "run-1", "run-2"]
        assert rt.stats()["starts_refused"] == 1
        assert "tangram_starts_refused_total 1.0" in metrics.render()[0].decode()
        rt.check_whole()
    finally:
        await rt.close()


@pytest.mark.timeout(60)
async def test_a_start_refused_by_the_last_event_is_tried_again_on_a_timer(tmp_path: Path):
    """Nothing else runs or comes: only the engine's retry (``next_wakeup``, START_RETRY_S later)
    can start the refused command, and it does."""
    mgr = RefusingManager({"cpu@n0": 2, "mem@n0": 10_000})
    eng = Engine([mgr])
    rt = Runtime(eng, env_executors={"n0": LocalExecutor(str(tmp_path / "envs"), sandbox="none")})
    try:
        blocker = rt.submit(rt.build_action("exec", {"cpu": 2}, environment=None, command="sleep 0.3"))
        aid = rt.submit(rt.build_action("exec", {"cpu": 1}, environment=None, command="echo late"))
        mgr.refuse[aid] = (AllocationError("cpu@n0: refused once for the test"), 1)
        await asyncio.wait_for(rt.wait(blocker), 30)
        assert rt.state(aid) == "waiting" and eng.starts_refused == 1 and not eng.running
        assert eng.next_wakeup() is not None
        outcome = await asyncio.wait_for(rt.wait(aid), 30)
        assert (outcome.status, outcome.stdout.strip()) == ("succeeded", "late")
        assert outcome.timing.queued_s >= START_RETRY_S * 0.9  # it waited for the retry
        rt.check_whole()
    finally:
        await rt.close()
