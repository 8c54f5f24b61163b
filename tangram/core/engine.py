"""The engine: queue, running set, managers and the policy call (DESIGN.md §6).

Synchronous and clock-injected: the aiohttp service drives it with the real
clock and real executors, the simulator with a virtual clock and simulated
executors. It never touches the outside world: every call returns the
actions that start now (:class:`Started`), and the driver runs them and
reports back with :meth:`Engine.complete`.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

from tangram.core.errors import UnknownActionError, UnschedulableError
from tangram.core.estimator import DurationEstimator
from tangram.core.grants import Grant
from tangram.core.model import Action
from tangram.core import feasibility, restarts, skips
from tangram.core.generating import Generating
from tangram.core.last_round import LastRound
from tangram.core.offered import OfferedLoad
from tangram.core.queue import LaneKey, Lanes, lane_bound, lane_key, lane_pools
from tangram.core.records import FINAL_STATES, RUNNING, WAITING, ActionRecord, Started, check_grants
from tangram.core.running import RunBooks, RunningView
from tangram.managers.base import AllocationError, ResourceManager
from tangram.policy.memo import drop_entries_of
from tangram.policy.order import params_key
from tangram.policy.schedule import plan as elastic_plan
from tangram.policy.snapshot import Dispatch, Plan, PolicyParams, PoolState, Snapshot, pool_name

Policy = Callable[[Snapshot], Plan]
log = logging.getLogger(__name__)
START_RETRY_S = 1.0  # a refused start is tried again this soon if no event comes first (next_wakeup)


class Engine:
    """Submit, complete, cancel; each returns the actions that start now."""

    def __init__(
        self,
        managers: Sequence[ResourceManager],
        *,
        clock: Callable[[], float] = time.monotonic,
        params: PolicyParams | None = None,
        policy: Policy = elastic_plan,
        estimator: DurationEstimator | None = None,
        keep_finished: int = 100_000,
    ):
        self.managers = list(managers)
        self.clock = clock
        self._params = params or PolicyParams()
        self.policy = policy
        self.estimator = estimator or DurationEstimator()
        self._keep_finished = keep_finished
        self._owner: dict[str, ResourceManager] = {}
        self._refresh_owners()
        self.waiting: dict[str, ActionRecord] = {}  # insertion order is arrival order
        self._lanes = Lanes()  # the same actions, in lanes sorted by the policy's order
        self._waiting_cpu_of: dict[str, set[str]] = {}  # trajectory -> its waiting CPU actions
        self._hostable: dict[str, tuple[str, ...]] = {}  # Snapshot.hostable
        self._last = LastRound()  # what the last round left: events skip or narrow their rounds by it
        self._tail_key = float("-inf")  # the largest order key waiting after the last round
        self._nodes: tuple[str, ...] = ()
        self._nodes_of: tuple[set[str], tuple[str, ...]] | None = None
        self.running: dict[str, ActionRecord] = {}
        # oldest first; an OrderedDict drops its oldest in O(1) (a dict's first key after
        # many pops from the front is found by a scan over the deleted slots)
        self.finished: OrderedDict[str, ActionRecord] = OrderedDict()
        self.placement: dict[str, str] = {}  # trajectory -> node
        self._generating = Generating()  # placed trajectories with nothing queued or running
        self.generating = self._generating  # the runtime forgets its loose trajectories here (no round)
        self._offered = OfferedLoad()  # elastic work submitted lately, per type (PolicyParams.offered_load_caps)
        self._placed_mem: dict[str, tuple[str, int]] = {}  # holder -> (mem pool, MiB)
        # the running actions per pool and per GPU service, in start order (the snapshot's completion-heap
        # seed, kept incrementally instead of walking every running action), and the restartable ones
        self.books = RunBooks()
        # rounds run (those over part of the lanes among them), rounds skipped, runs restarted wider,
        # dispatches a manager refused (or that raised) when the round started them (Engine._start_all)
        self.rounds = self.rounds_partial = self.rounds_skipped = self.runs_restarted = self.starts_refused = 0
        self._retry_at: float | None = None  # when to try a refused start again (Engine._try_start)

    # ------------------------------------------------------------------ #
    # topology

    def _refresh_owners(self) -> None:
        self._owner.clear()
        for m in self.managers:
            for p in m.pool_states():
                if p.name in self._owner:
                    raise ValueError(f"pool {p.name!r} is owned by two managers")
                self._owner[p.name] = m

    @property
    def params(self) -> PolicyParams:
        return self._params

    @params.setter
    def params(self, params: PolicyParams) -> None:
        """New knobs: the next round re-decides everything (no skipped round reads the old ones)."""
        self._params = params
        self._last.forget()

    def manager_of(self, pool: str) -> ResourceManager | None:
        return self._owner.get(pool)

    def pool_states(self) -> dict[str, PoolState]:
        return {p.name: p for m in self.managers for p in m.pool_states()}

    def nodes(self, pools: Mapping[str, PoolState] | None = None) -> tuple[str, ...]:
        pools = self.pool_states() if pools is None else pools
        if self._nodes_of is not None and self._nodes_of[0] == pools.keys():
            return self._nodes_of[1]  # same pools as last time (every round asks)
        nodes = tuple(dict.fromkeys(p.node for p in pools.values() if p.node is not None))
        self._nodes_of = (set(pools), nodes)
        return nodes

    # ------------------------------------------------------------------ #
    # events

    def submit(self, action: Action) -> list[Started]:
        """Queue ``action`` (rejecting a demand that can never fit) and schedule."""
        if action.id in self.waiting or action.id in self.running or action.id in self.finished:
            raise UnschedulableError("id", f"action {action.id!r} was already submitted")
        pools = self.pool_states()
        self.check_feasible(action, pools)
        action = self.estimator.refine(self.cap_to_capacity(action, pools), self._params.learn_unprofiled)
        now = self.clock()
        action = self._offered.cap(action, pools, self._params.offered_load_caps, now)
        rec = ActionRecord(action, submitted_at=now)
        hostable = self._hostable.get(action.trajectory)  # where its trajectory may go (a change runs the round)
        key = self._enqueue(rec)
        arrivals_moved = self._generating.submitted(action, rec.submitted_at, self._params.arrival_gap == "residual")
        if self._hostable.get(action.trajectory) != hostable:
            return self.schedule()
        if key >= self._tail_key and self._cannot_start(action) and not self._moves_a_choice(action, arrivals_moved):
            # it sorts behind every waiting action and the last round's leftovers
            # already shut every pool it could use: that round's outcome stands
            self._tail_key = key
            self.rounds_skipped += 1
            return []
        if arrivals_moved is True or self._last.unfit is None:
            return self.schedule()
        dirty = lane_pools(self._lanes.lane_of(action.id), self.nodes(pools))
        return self._round(dirty | {f"{t}@{arrivals_moved}" for t in ("cpu", "gpu")} if arrivals_moved else dirty,
                           pools)

    def complete(self, action_id: str, status: str = "succeeded", *, restore_s: float = 0.0) -> list[Started]:
        """The driver reports that a running action ended; free its units and schedule.

        ``restore_s``: seconds of its execution spent restoring its GPU service
        (a cache miss). The duration estimates observe the rest, the action's
        own run: a restore is charged apart, per DoP (``Action.restore_s``), so
        counting it in the class's ``T1`` too would charge it twice and inflate
        the order key and the DoP choice of every later action of the class.
        """
        if status not in FINAL_STATES:
            raise ValueError(f"status: must be one of {sorted(FINAL_STATES)}, got {status!r}")
        if not (restore_s >= 0 and math.isfinite(restore_s)):  # NaN and inf too, before any state changes
            raise ValueError(f"restore_s: must be a finite number >= 0, got {restore_s!r}")
        rec = self.running.pop(action_id, None)
        if rec is None:
            raise UnknownActionError(f"action {action_id!r} is not running")
        self._finish(rec, status)
        moved: tuple[str, ...] = ()  # the classes whose published estimates moved
        if status == "succeeded" and rec.exec_s is not None:
            units = rec.dispatch.units.get(rec.action.key, 0) if rec.action.key else 0
            moved = self.estimator.observe(rec.action, units, rec.exec_s - restore_s)
        if moved and not self._last.holdout_classes.isdisjoint(moved):
            started = self.schedule()
        elif self._release_wakes_nothing():
            self.rounds_skipped, started = self.rounds_skipped + 1, []
        else:
            started = self._round(set())
        return started + restarts.restart_stragglers(self) if self.books.restartable and status == "succeeded" else started

    def _round(self, dirty: set[str], pools: Mapping[str, PoolState] | None = None) -> list[Started]:
        """A round when only ``dirty`` pools changed since the last one (those released since, and those
        where it left something waiting by choice, change too): over the lanes that concern
        (skips.replan_scope), or a full one."""
        last = self._last
        if last.unfit is None:
            return self.schedule()
        pools = self.pool_states() if pools is None else pools
        scope = skips.replan_scope(self._lanes.items(), dirty | last.released | last.chosen, self.nodes(pools), pools)
        return self.schedule() if scope is None else self.schedule(only=scope)

    def cancel(self, action_id: str) -> list[Started]:
        """Cancel a waiting or running action (the driver kills a running one)."""
        return self._end(action_id, "cancelled", None)

    def requeue(self, action_id: str) -> list[Started]:
        """Put a running action back at the head of the queue, its grants given back.

        For a call the upstream refused (a 429): it keeps its submit time and
        goes first again once its pool has capacity.
        """
        rec = self.running.pop(action_id, None)
        if rec is None:
            raise UnknownActionError(f"action {action_id!r} is not running")
        self._release_grants(rec)
        rec.state, rec.started_at, rec.dispatch, rec.grants, rec.estimated_end = WAITING, None, None, {}, 0.0
        self.waiting = {action_id: rec, **self.waiting}  # rare: rebuilding the order is fine
        self._enqueue(rec, first=True)
        # a held group read it as running for its time left; it restarts for its whole run, under
        # the same id (Plan.holdouts keeps ids): every group is re-decided
        self._last.forget()
        return self.schedule()

    def fail(self, action_id: str, reason: str) -> list[Started]:
        """End a waiting action as ``failed`` because of ``reason`` (e.g. its node went down).

        A running action may be failed too, once the driver knows its process
        is gone (its units are given back now). Failing a finished action does
        nothing.
        """
        return self._end(action_id, "failed", reason)

    def _end(self, action_id: str, status: str, reason: str | None) -> list[Started]:
        rec = self._unqueue(action_id) or self.running.pop(action_id, None)
        if rec is None:
            if action_id in self.finished:
                return []
            raise UnknownActionError(f"action {action_id!r} is unknown")
        self._last.unfit = None  # a waiting head that reserved pools may be gone
        rec.error = reason
        self._finish(rec, status)
        return self.schedule()

    def place_trajectory(self, trajectory: str, node: str, mem_mb: int) -> None:
        """Pin ``trajectory`` to ``node`` with ``mem_mb`` reserved there, as its first action would have
        (an environment reattached after a restart); raises if the memory is not free."""
        if trajectory in self.placement or trajectory in self._placed_mem:
            raise ValueError(f"trajectory {trajectory!r} is placed already")
        if mem_mb:
            mpool = pool_name("mem", node)
            self._owner[mpool].allocate(mpool, mem_mb, trajectory)
            self._placed_mem[trajectory] = (mpool, mem_mb)
        self.placement[trajectory] = node
        self._hostable.pop(trajectory, None)
        self._relane(trajectory)

    def close_trajectory(self, trajectory: str) -> list[Started]:
        """The trajectory ended: its memory reservation and node pin go away."""
        if self.placement.pop(trajectory, None) is not None:
            self._relane(trajectory)
        self._release_mem(trajectory)
        self._generating.closed(trajectory)
        return self.schedule()

    def tick(self) -> list[Started]:
        """Re-run the policy (a quota period refilled, a node came back, ...)."""
        self._last.forget()  # an explicit re-run re-decides every group
        return self.schedule()

    def next_wakeup(self) -> float | None:
        now = self.clock()
        times = [t for m in self.managers if (t := m.next_wakeup(now)) is not None]
        times += [self._retry_at] if self._retry_at is not None else []
        return min(times) if times else None

    def refilled_unseen(self) -> bool:
        """A manager's pools gained units on their own since the last round read them (a round is due now)."""
        now = self.clock()
        return any(m.refilled_unseen(now) for m in self.managers)

    # ------------------------------------------------------------------ #
    # scheduling

    def snapshot(self, only: tuple[LaneKey, ...] | None = None) -> Snapshot:
        """What the policy reads; ``only``: with those lanes' actions alone waiting (Engine._round)."""
        pools = self.pool_states()
        nodes = self.nodes(pools)
        extra = 1 + self.params.lookahead  # the blocked head, and what the ACT estimate looks at
        view = self._lanes.view(lambda lane: lane_bound(lane, pools, nodes) + extra, only)
        now = self.clock()
        return Snapshot(
            pools=pools, nodes=nodes, waiting=view, waiting_keys=view.keys,
            running=RunningView(self.books.by_pool, now), running_services=RunningView(self.books.by_service, now),
            placement=MappingProxyType(self.placement),  # read only during the synchronous call
            class_estimates=self.estimator.class_estimates(),  # read only during the synchronous call
            upcoming=self._generating.view(self.clock(), self.params.lookahead, self.params.arrival_gap == "residual"),
            params=self.params,
            holdouts=self._last.holdouts,
            hostable=MappingProxyType(self._hostable),  # read only during the synchronous call
        )

    def schedule(self, only: tuple[tuple[LaneKey, ...], tuple[str, ...]] | None = None) -> list[Started]:
        """Run a round; ``only``: lanes and the pools they could use, when a round over them alone plans
        what a full round would (skips.replan_scope): the rest of the last round's outcome stands."""
        if only is not None:
            self.rounds += 1
            self.rounds_partial += 1
            snap = self.snapshot(only[0])
            result = self.policy(snap)
            self._last.took_part(result, [p for p in only[1] if p in snap.pools])
            return self._start_all(result)
        self._retry_at = None  # a full round tries every waiting action: a refusal in it sets it again
        if not self.waiting:
            self._last.released.clear()
            self._last.unfit, self._tail_key = None, float("-inf")
            return []
        self.rounds += 1
        snap = self.snapshot()
        self._nodes = snap.nodes
        result = self.policy(snap)
        self._last.took(result, snap.pools)
        return self._start_all(result)

    def _start_all(self, result: Plan) -> list[Started]:
        self._tail_key = self._lanes.max_key()
        p = self.params
        if p.order == "aging" and p.affinity_k > 0 and any(lane[3] is not None for lane, _ in self._lanes.items()):
            # GPU affinity considers a waiting GPU action that would restore later than its key
            # (policy/affinity.py): no new action's key is then known to sort behind every one
            self._tail_key = float("inf")
        if len(result.dispatches) <= 1:  # most rounds: nothing to order
            return [s for d in result.dispatches if (s := self._try_start(d)) is not None]
        # buddy chunks are placed largest first, which is what the policy's packing assumed
        ordered = sorted(result.dispatches, key=lambda d: -d.units.get("gpu", 0))
        started = [s for d in ordered if (s := self._try_start(d)) is not None]
        order = {d.action.id: i for i, d in enumerate(result.dispatches)}
        started.sort(key=lambda s: order[s.action.id])
        return started

    def _try_start(self, d: Dispatch) -> Started | None:
        """Start ``d``, or leave it waiting where a manager refuses it (or anything raises): logged and
        counted, and the round's other starts stand (raising would lose those made before, grants held)."""
        try:
            if d.action.id in self.waiting:
                return self._start(d)
            log.error("action %s: dispatched by the policy but not waiting; not started", d.action.id)
        except AllocationError as exc:  # _start put it back in the queue, holding nothing
            log.warning("action %s: not started, a manager refused it: %s", d.action.id, exc)
        except Exception:  # noqa: BLE001 - the same, for a bug, which must not lose the other starts either
            log.exception("action %s: not started", d.action.id)
        self.starts_refused += 1
        self._retry_at = self.clock() + START_RETRY_S  # the round may be the last event for a while
        return None

    def _start(self, d: Dispatch) -> Started:
        rec = self._unqueue(d.action.id)
        a = d.action
        grants: dict[str, Grant] = {}
        try:
            if d.place_mem_mb:
                holder = a.trajectory or a.id
                mpool = pool_name("mem", d.node)
                self._owner[mpool].allocate(mpool, d.place_mem_mb, holder, a)
                self._placed_mem[holder] = (mpool, d.place_mem_mb)
            if a.trajectory is not None and "cpu" in a.demands and d.node is not None:
                self._hostable.pop(a.trajectory, None)  # placed: it goes nowhere else
                if self.placement.setdefault(a.trajectory, d.node) == d.node:
                    self._relane(a.trajectory)
            for rtype, pname in d.pools.items():
                grants[pname] = self._owner[pname].allocate(pname, d.units[rtype], a.id, a)
        except Exception:
            for pname in grants:  # nothing leaks when a manager refuses
                self._owner[pname].release(pname, a.id)
            if d.place_mem_mb and a.trajectory is None:
                self._release_mem(a.id)
            self.waiting[a.id] = rec
            self._enqueue(rec)
            self._last.forget()  # a held group read it as running from now
            raise
        now = self.clock()
        rec.state, rec.started_at, rec.dispatch, rec.grants = RUNNING, now, d, grants
        rec.estimated_end = now + (d.estimated_s or self.params.default_duration_s)
        self.running[a.id] = rec
        # a one-shot's environment ends with its run: not restartable
        self.books.enter(a, d.pools, d.units, now, rec.estimated_end,
                         a.restartable and a.key == "cpu" and a.trajectory is not None)
        return Started(rec, d, grants)

    def _finish(self, rec: ActionRecord, status: str) -> None:
        rec.state = status
        rec.finished_at = self.clock()
        self._release_grants(rec)
        node = self.placement.get(rec.action.trajectory)
        if self._generating.ended(rec.action, node, rec.finished_at):
            self._last.released.add(pool_name("cpu", node))  # its expected arrivals changed (Snapshot.upcoming)
        self.finished[rec.action.id] = rec
        if len(self.finished) > self._keep_finished:
            self.finished.popitem(last=False)

    def _release_grants(self, rec: ActionRecord) -> None:
        for pname in rec.grants:
            self._owner[pname].release(pname, rec.action.id)
            self._last.release(pname)
        self.books.leave(rec.action.id, rec.dispatch.pools.values() if rec.dispatch is not None else (),
                         rec.action.service)
        if rec.action.trajectory is None:
            self._release_mem(rec.action.id)  # a one-shot action's memory lives with it

    def _release_mem(self, holder: str) -> None:
        placed = self._placed_mem.pop(holder, None)
        if placed is not None:
            self._owner[placed[0]].release(placed[0], holder)
            self._last.release(placed[0])

    # ------------------------------------------------------------------ #
    # the waiting queue's lanes

    def _enqueue(self, rec: ActionRecord, *, first: bool = False) -> float:
        """Into its lane at its order key (``first``: ahead of everything); returns the key."""
        a = rec.action
        self.waiting.setdefault(a.id, rec)
        done, gen = self._generating.order_inputs(a.trajectory, rec.submitted_at, self.params)
        key = float("-inf") if first else params_key(a, rec.submitted_at, self.params, self.estimator.class_estimates(),
                                                     done, gen)
        self._lanes.add(a, lane_key(a, self.placement, self._hostable), key)
        if a.trajectory is not None and "cpu" in a.demands:
            ids = self._waiting_cpu_of.setdefault(a.trajectory, set())
            ids.add(a.id)
            if len(ids) > 1 or a.trajectory in self._hostable:
                self._update_hostable(a.trajectory)
        return key

    def _unqueue(self, action_id: str) -> ActionRecord | None:
        rec = self.waiting.pop(action_id, None)
        if rec is not None:
            drop_entries_of(rec.action)  # what the policy derived from it goes with it (policy/memo.py)
            self._lanes.discard(action_id)
            t = rec.action.trajectory
            if t is not None and (ids := self._waiting_cpu_of.get(t)) is not None:
                ids.discard(action_id)
                if not ids:
                    del self._waiting_cpu_of[t]
                if t in self._hostable:
                    self._update_hostable(t)
        return rec

    def _update_hostable(self, trajectory: str) -> None:
        """Snapshot.hostable of an unplaced ``trajectory`` (feasibility.hostable_nodes)."""
        ids, old = self._waiting_cpu_of.get(trajectory, ()), self._hostable.pop(trajectory, None)
        if trajectory not in self.placement and len(ids) > 1:
            pools = self.pool_states()
            if ok := feasibility.hostable_nodes([self.waiting[i].action for i in ids], self.nodes(pools), pools):
                self._hostable[trajectory] = ok
        if self._hostable.get(trajectory) != old:
            self._relane(trajectory)

    def _relane(self, trajectory: str) -> None:
        """The trajectory's node changed: its waiting CPU actions change lanes."""
        for aid in self._waiting_cpu_of.get(trajectory, ()):
            self._lanes.move(aid, lane_key(self.waiting[aid].action, self.placement, self._hostable))

    def _release_wakes_nothing(self) -> bool:
        """Whether a round now would start nothing (skips.release_wakes_nothing)."""
        last = self._last
        if not last.settled or not self.waiting:
            return False
        return skips.release_wakes_nothing(self._lanes.items(), last.released)

    def _moves_a_choice(self, a: Action, arrivals_moved: str | bool) -> bool:
        home = self.placement.get(a.trajectory) if a.trajectory is not None else None
        return skips.moves_a_choice(self._last.unfit, self._owner, a, home, arrivals_moved)

    def _cannot_start(self, a: Action) -> bool:
        if not self._last.unfit:
            return False
        home, mem = (self._lanes.lane_of(a.id) or lane_key(a, self.placement, self._hostable))[:2]
        return skips.cannot_start(self._last.unfit, a, home, mem, self._nodes)

    # ------------------------------------------------------------------ #
    # feasibility and checks

    def check_feasible(self, action: Action, pools: Mapping[str, PoolState] | None = None) -> None:
        """Reject a demand that no node can ever satisfy, alone or with its unplaced trajectory's (never queued)."""
        pools = self.pool_states() if pools is None else pools
        bound = self.placement.get(action.trajectory) if (action.trajectory and "cpu" in action.demands) else None
        feasibility.check(action, pools, self.nodes(pools), bound,
                          [self.waiting[i].action for i in sorted(self._waiting_cpu_of.get(action.trajectory, ()))])

    def cap_to_capacity(self, action: Action, pools: Mapping[str, PoolState] | None = None) -> Action:
        """``action`` with every demand's max lowered to the largest pool that could host it."""
        return feasibility.cap_to_capacity(action, self.pool_states() if pools is None else pools)

    def check_invariants(self) -> None:
        check_grants(self.managers, self.running, self._placed_mem)

    # ------------------------------------------------------------------ #
    # introspection

    def record(self, action_id: str) -> ActionRecord:
        for table in (self.waiting, self.running, self.finished):
            if (rec := table.get(action_id)) is not None:
                return rec
        raise UnknownActionError(f"action {action_id!r} is unknown")

    def records(self) -> Iterable[ActionRecord]:
        yield from self.finished.values()
        yield from self.running.values()
        yield from self.waiting.values()

