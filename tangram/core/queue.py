"""The engine's waiting queue, in lanes of interchangeable actions.

A lane holds the waiting actions that need the same pools in the same
minimum amounts (same demands, same home node or none, same memory to
place) and, for GPU actions, name the same service (so a round sees the
head of every service's queue, which GPU affinity needs). Within a round, free units only shrink and blocked pools only grow,
so once one action of a lane cannot start, none behind it in the same lane
can. A round therefore needs, from each lane, at most as many actions as
its pools' free units could start, one more (the blocked head, which
reserves its pools) and the look-ahead of the ACT estimate: the view handed
to the policy merges the lanes' sorted prefixes of that length, so a
round's cost follows the free capacity and the look-ahead, not the queue.

Each lane is kept sorted by the order key (:mod:`tangram.policy.order`),
arrival breaking ties; the key is fixed per action, so sorting happens
once, on insert.
"""
from __future__ import annotations

import heapq
from itertools import islice
from operator import itemgetter
from typing import Callable, Iterator, Mapping

from sortedcontainers import SortedList

from tangram.core.model import Action

_ACTION = itemgetter(2)  # an entry is (order key, arrival sequence, action)

# (home node or None, memory to place in MiB, demands as (rtype, Demand) pairs, GPU service or None)
LaneKey = tuple


class Lanes:
    """Waiting entries ``(order key, arrival seq, action)`` grouped by lane.

    Entries compare as plain tuples: the arrival sequence is unique, so the
    action itself is never compared.
    """

    __slots__ = ("_lanes", "_where", "_seq")

    def __init__(self) -> None:
        self._lanes: dict[LaneKey, SortedList] = {}
        self._where: dict[str, tuple[LaneKey, tuple]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._where

    def add(self, action: Action, lane: LaneKey, key: float) -> None:
        self._seq += 1
        entry = (key, self._seq, action)
        self._lanes.setdefault(lane, SortedList()).add(entry)
        self._where[action.id] = (lane, entry)

    def discard(self, action_id: str) -> None:
        hit = self._where.pop(action_id, None)
        if hit is None:
            return
        lane, entry = hit
        entries = self._lanes[lane]
        entries.remove(entry)
        if not entries:
            del self._lanes[lane]

    def move(self, action_id: str, lane: LaneKey) -> None:
        """Put a waiting action in another lane, keeping its key and arrival."""
        hit = self._where.get(action_id)
        if hit is None or hit[0] == lane:
            return
        self.discard(action_id)
        self._lanes.setdefault(lane, SortedList()).add(hit[1])
        self._where[action_id] = (lane, hit[1])

    def in_order(self) -> list[Action]:
        """Every waiting action in the order a round would read them (O(n log n): introspection)."""
        return [e[2] for e in sorted((e for entries in self._lanes.values() for e in entries))]

    def max_key(self) -> float:
        """The largest order key waiting (-inf when empty)."""
        return max((entries[-1][0] for entries in self._lanes.values()), default=float("-inf"))

    def lane_of(self, action_id: str) -> LaneKey | None:
        hit = self._where.get(action_id)
        return None if hit is None else hit[0]

    def items(self):
        return self._lanes.items()

    def view(self, take: Callable[[LaneKey], int], only: tuple[LaneKey, ...] | None = None) -> "LanesView":
        """The first ``take(lane)`` actions of every lane (``only``: of those), merged in order."""
        return LanesView(self, take, only)


class LanesView:
    """Read-only merged view for one policy call (nothing mutates during it)."""

    __slots__ = ("_lanes", "_take", "_len", "_only")

    def __init__(self, lanes: Lanes, take: Callable[[LaneKey], int], only: tuple[LaneKey, ...] | None = None):
        self._lanes = lanes
        self._take = take
        self._only = only
        self._len = len(lanes) if only is None else sum(len(lanes._lanes.get(lane, ())) for lane in only)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Action]:
        return map(_ACTION, self._entries())  # C-level: a round reads each through several generators

    def _entries(self) -> Iterator[tuple]:
        parts = []
        lanes = self._lanes.items() if self._only is None else [(k, self._lanes._lanes.get(k, ())) for k in self._only]
        for lane, entries in lanes:
            n = self._take(lane)
            if n > 0:
                parts.append(islice(entries, n))
        if len(parts) == 1:
            return iter(parts[0])
        return heapq.merge(*parts)

    @property
    def keys(self) -> "OrderKeys":
        """The order keys of the actions this view yields, in the same order (re-iterable)."""
        return OrderKeys(self)

    def __getitem__(self, i: int) -> Action:  # rare (tests, debugging): O(i)
        items = list(self)
        return items[i]


class OrderKeys:
    """``iter()`` gives the keys of a :class:`LanesView`'s actions (``Snapshot.waiting_keys``)."""

    __slots__ = ("_view",)

    def __init__(self, view: LanesView):
        self._view = view

    def __iter__(self) -> Iterator[float]:
        return (e[0] for e in self._view._entries())


def lane_key(a: Action, placement: Mapping[str, str], hostable: Mapping[str, tuple[str, ...]]) -> LaneKey:
    """The lane of waiting ``a``: a CPU action's home is its trajectory's node (``placement``); one whose
    trajectory is unplaced places its memory, and keeps to the nodes that trajectory may go to
    (``hostable``, where known: a fifth field)."""
    home, mem = None, 0
    if "cpu" in a.demands:
        home = placement.get(a.trajectory) if a.trajectory is not None else None
        mem = a.mem_mb if home is None else 0
    restricted = (hostable[a.trajectory],) if home is None and a.trajectory in hostable else ()
    return (home, mem, tuple(sorted(a.demands.items())), a.service if "gpu" in a.demands else None) + restricted


def lane_bound(lane: LaneKey, pools: Mapping, nodes: tuple[str, ...]) -> int:
    """How many actions of ``lane`` the free units could start at most (an upper bound)."""
    home, mem, demands = lane[:3]
    bound = None
    for rtype, demand in demands:
        if rtype == "cpu" or rtype == "gpu":
            names = (f"{rtype}@{home}",) if (home is not None and rtype == "cpu") else [f"{rtype}@{n}" for n in nodes]
        else:
            names = (rtype,)
        free = 0
        for name in names:
            p = pools.get(name)
            if p is not None and p.free > 0:
                free += p.free
        n = free // demand.min
        bound = n if bound is None or n < bound else bound
    if mem:
        n = 0
        for node in nodes:
            p = pools.get(f"mem@{node}")
            if p is not None:
                n += p.free // mem
        bound = n if bound is None or n < bound else bound
    return bound or 0


def lane_pools(lane: LaneKey, nodes: tuple[str, ...]) -> set[str]:
    """The pools an action of ``lane`` could start in or reserve: those :func:`lane_uses` answers for."""
    home, mem, demands = lane[:3]
    names = {f"mem@{n}" for n in nodes} if mem else set()
    for rtype, _ in demands:
        if rtype == "cpu" and home is not None:
            names.add(f"cpu@{home}")
        elif rtype == "cpu" or rtype == "gpu":
            names.update(f"{rtype}@{n}" for n in nodes)
        else:
            names.add(rtype)
    return names


def lane_uses(lane: LaneKey, pools: set[str]) -> bool:
    """Whether an action of ``lane`` could start in, or reserve, any of ``pools``.

    A node-local demand of a placed trajectory uses its home node's pool; any
    other node-local demand (and an unplaced trajectory's memory) every node's.
    """
    home, mem, demands = lane[:3]
    for pname in pools:
        parts = _SPLIT.get(pname)
        if parts is None:
            parts = _split(pname)
        rtype, node = parts
        if node and rtype == "mem":
            if mem:
                return True
            continue
        for t, _ in demands:
            if t == rtype:
                if not node or home is None or rtype != "cpu" or home == node:
                    return True
                break
    return False


# pool name -> (resource type, node or ""): the engine asks lane_uses about every waiting lane and
# the pools a release touched, many times per round, of a cluster's few pool names
_SPLIT: dict[str, tuple[str, str]] = {}
_SPLIT_MAX = 1 << 14  # nodes come and go in a long-lived service: start over rather than grow


def _split(pname: str) -> tuple[str, str]:
    if len(_SPLIT) >= _SPLIT_MAX:
        _SPLIT.clear()
    rtype, _, node = pname.partition("@")
    parts = _SPLIT[pname] = (rtype, node)
    return parts
