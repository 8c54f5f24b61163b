"""The work each resource type was offered lately: what the offered-load DoP cap reads.

Each elastic action submitted adds its work at its smallest DoP (units x seconds) at
its submission time. :meth:`OfferedLoad.load` is the work submitted on a type in the
last ``window`` seconds (or since the type's first submission, if that is shorter)
over what the type's capacity does in that time: the utilisation the type would need
to serve it at the smallest DoPs. :meth:`OfferedLoad.cap` records a submitted action
and applies the policy's cap (``tangram.policy.offered_load``) to it.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_left
from types import MappingProxyType
from typing import Mapping

from tangram.core.model import Action
from tangram.core.pools import PoolState
from tangram.policy.offered_load import offered_load_cap

# submissions kept per type (between MAX_KEPT and twice that: the older half goes at once): a
# window that spans more reads only the latest ones (a lower load, so a looser cap), and the
# books stay bounded whatever the service's uptime
MAX_KEPT = 1 << 16


class _Books:
    __slots__ = ("first", "times", "cumulative")

    def __init__(self, now: float) -> None:
        self.first = now  # the first submission ever: a window does not reach before it
        self.times: list[float] = []
        # work submitted before times[i] is cumulative[i] (from the first submission, dropped ones included)
        self.cumulative: list[float] = [0.0]


class OfferedLoad:
    """Per resource type: when elastic work was submitted, and how much."""

    __slots__ = ("_books",)

    def __init__(self) -> None:
        self._books: dict[str, _Books] = {}

    def add(self, rtype: str, now: float, work: float) -> None:
        """``work`` unit-seconds submitted on ``rtype`` at ``now`` (the engine's clock, never decreasing)."""
        b = self._books.get(rtype)
        if b is None:
            b = self._books[rtype] = _Books(now)
        b.times.append(now)
        b.cumulative.append(b.cumulative[-1] + work)
        if len(b.times) > 2 * MAX_KEPT:  # drop the older half: amortised O(1) per submission
            cut = len(b.times) - MAX_KEPT
            del b.times[:cut]
            del b.cumulative[:cut]

    def load(self, rtype: str, now: float, window: float, capacity: int) -> float | None:
        """Work submitted on ``rtype`` in the last ``window`` seconds (at most since its first
        submission) over ``window x capacity``; None while there is no time span to measure over."""
        b = self._books.get(rtype)
        if b is None or capacity <= 0:
            return None
        since = now - b.first
        if since <= window:  # every submission kept (not ``now - since``: it may round past the first)
            if not since > 0.0:
                return None
            return (b.cumulative[-1] - b.cumulative[0]) / (since * capacity)
        i = bisect_left(b.times, now - window)  # the window's edge included
        return (b.cumulative[-1] - b.cumulative[i]) / (window * capacity)

    def cap(self, a: Action, pools: Mapping[str, PoolState], factors: Mapping[str, float], now: float) -> Action:
        """Record elastic ``a``, submitted at ``now``, on its key type if ``factors`` names the type,
        and return it with that demand capped for the load (``PolicyParams.offered_load_caps``)."""
        rtype = a.key
        factor = factors.get(rtype) if (factors and rtype is not None) else None
        if not factor or a.t1_s is None or a.elasticity is None:
            return a
        d = a.demands[rtype]
        t_min = a.duration(d.min)
        self.add(rtype, now, t_min * d.min)
        capacity = sum(p.capacity for p in pools.values() if p.rtype == rtype)
        capped = offered_load_cap(a, rtype, self.load(rtype, now, t_min, capacity), factor)
        if capped is None:
            return a
        # ``key`` stays even when one option is left (feasibility.cap_to_capacity drops it there):
        # the action is still elastic in kind, and the estimator learns its class's T1 from it
        return dataclasses.replace(a, demands=MappingProxyType({**a.demands, rtype: capped}))
