"""GPU affinity: which idle resident instances a round may hand out, and the order that favours them.

A GPU action whose service is resident on a free chunk (an *idle instance*,
:attr:`PoolState.idle`) starts there without a restore. A round keeps the
unclaimed idle instances per pool (:class:`Affinity`) and considers the
waiting actions in :func:`affinity_order`, so that the queued actions of a
resident service take its instance before another service evicts it.
"""
from __future__ import annotations

import heapq

from tangram.core.grants import parse_service
from tangram.core.model import Action
from tangram.policy.order import expected_s
from tangram.policy.snapshot import Snapshot


class Affinity:
    """The idle resident GPU instances not yet claimed this round: pool -> model -> DoP -> count."""

    __slots__ = ("left", "unclaimed", "busy", "frees")

    def __init__(self, pools) -> None:
        self.left: dict[str, dict[str, dict[int, int]]] = {}
        # model -> its idle instances not yet claimed, over every pool: most waiting GPU actions'
        # services have none, and a round asks for each of them (affinity_order)
        self.unclaimed: dict[str, int] = {}
        self.busy: dict[str, dict[int, int]] = {}  # model -> DoP -> resident instances that are running
        # (model, DoPs) -> min-heap of when each of its usable busy instances frees, past the actions held
        # for it this round (:func:`_hold`)
        self.frees: dict[tuple[str, frozenset[int]], list[float]] = {}
        for name, p in pools.items():
            idle = p.idle if p.idle is not None else p.resident if p.chunked else ()
            for service in idle:
                model, dop = parse_service(service)
                per = self.left.setdefault(name, {}).setdefault(model, {})
                per[dop] = per.get(dop, 0) + 1
                self.unclaimed[model] = self.unclaimed.get(model, 0) + 1
            if p.chunked and p.idle is not None:
                for service in p.resident:
                    if service not in idle:
                        model, dop = parse_service(service)
                        per = self.busy.setdefault(model, {})
                        per[dop] = per.get(dop, 0) + 1

    def dops(self, pname: str, a: Action) -> frozenset[int]:
        """The DoPs of ``a``'s options at which an unclaimed idle instance of its service sits in ``pname``."""
        return frozenset(self._usable(pname, a))

    def has(self, pname: str, a: Action) -> bool:
        """Whether :meth:`dops` is not empty (without building it)."""
        return next(self._usable(pname, a), None) is not None

    def _usable(self, pname: str, a: Action):
        per = self.left.get(pname)
        counts = per.get(a.service) if per and a.service is not None else None
        if counts:
            options = a.demands["gpu"].options
            yield from (u for u, n in counts.items() if n > 0 and u in options)

    def any_hit(self, a: Action, gpu_pools, closed) -> bool:
        if not self.unclaimed.get(a.service):
            return False
        for pname in gpu_pools:
            if pname not in closed and self.has(pname, a):
                return True
        return False

    def claim(self, pname: str, a: Action) -> frozenset[int]:
        """Take one idle instance for ``a`` (it runs on one): the DoP at which it ends soonest
        (the smaller on a tie), leaving the others to the actions after it."""
        hits = self.dops(pname, a)
        if not hits:
            return hits
        u = min(hits, key=lambda d: (a.duration(d) or 0.0, d))  # no T1 known: the smallest
        self.left[pname][a.service][u] -= 1
        self.unclaimed[a.service] -= 1
        return frozenset((u,))


def affinity_order(snap: Snapshot, affinity: Affinity, gpu_pools, closed):
    """The waiting actions in the order a round considers them (DESIGN.md §4.2).

    Under the aging order a GPU action with no idle instance of its service
    to take (it would pay a restore) either waits this round for a busy
    instance of its model (:func:`_hold`) or is considered ``affinity_k``
    times that restore later than its order key: queued actions of a resident service
    take their instance first, and a resident service is evicted only when
    none of its actions is near the head. The shift is bounded by the
    action's own restore time, so the order stays starvation-free. Lazy: a
    hit is judged when the action's turn comes, after the earlier claims.
    """
    params = snap.params
    keys = snap.waiting_keys
    if keys is None or params.order != "aging" or params.affinity_k <= 0 or not gpu_pools:
        return iter(snap.waiting)  # the queue's own order: no generator between it and the round
    return _deferring_misses(snap, affinity, gpu_pools, closed, keys, params.affinity_k)


def _deferring_misses(snap: Snapshot, affinity: Affinity, gpu_pools, closed, keys, k: float):
    deferred: list = []
    seq = 0
    for key, a in zip(keys, snap.waiting):
        while deferred and deferred[0][0] <= key:
            yield heapq.heappop(deferred)[2]
        if a.restore_s and a.service is not None and "gpu" in a.demands and not affinity.any_hit(a, gpu_pools, closed):
            if _hold(a, affinity, snap):
                continue  # its model's busy instance frees sooner than a restore would take
            seq += 1
            heapq.heappush(deferred, (key + k * max(a.restore_s.values()), seq, a))
            continue
        yield a
    while deferred:
        yield heapq.heappop(deferred)[2]


def _hold(a: Action, affinity: Affinity, snap: Snapshot) -> bool:
    """Whether ``a`` (it would restore) should wait for a busy instance of its model instead.

    Its model's busy instances at DoPs ``a`` can use free when their running
    actions end (``Snapshot.running_services``: seconds left, the instance's
    DoP; each running action of the model holds one instance); each action
    held this round takes the first to free and keeps it for its own expected
    duration (a min-heap of free times, one pop and push per hold). ``a`` waits while the first free time is sooner than the restore it
    would pay now at its smallest DoP. So a model with a short queue is served
    by its resident instances, one with a long queue spreads to new chunks, and
    a held action is a hit (a claim, in its order) when an instance frees.
    Instances with no running action known are taken to free evenly over
    ``a``'s expected duration.
    """
    # only instances at a DoP ``a`` can run at: one it cannot use would hold it for ever
    per = affinity.busy.get(a.service)
    if not per:
        return False
    options = a.demands["gpu"].options
    key = (a.service, options)
    frees = affinity.frees.get(key)
    expected = None  # read only when needed: most calls find the first instance frees too late
    if frees is None:
        expected = expected_s(a, snap.class_estimates, snap.params.default_duration_s)
        busy = sum(n for dop, n in per.items() if dop in options)
        left = sorted(s for s, dop in snap.running_services.get(a.service, ()) if dop in options)
        # sorted as a whole (a heap): a known time can be later than an evenly spread one
        frees = sorted(left + [(i + 1) * expected / busy for i in range(max(0, busy - len(left)))])
        affinity.frees[key] = frees
    if not frees:
        return False
    restore = a.restore_s.get(a.demands["gpu"].min, 0.0)
    if frees[0] < restore:
        if expected is None:
            expected = expected_s(a, snap.class_estimates, snap.params.default_duration_s)
        heapq.heapreplace(frees, frees[0] + expected)
        return True
    return False
