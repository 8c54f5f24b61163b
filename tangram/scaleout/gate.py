"""Take a node's pools out of scheduling while the node is down, without touching the managers.

:class:`NodeGate` wraps any :class:`ResourceManager`; every wrapper of one
cluster shares a :class:`DownNodes` set. The pools of a down node are simply
not reported by :meth:`pool_states`, so the policy (which skips nodes whose
pools are missing) stops placing on it and :meth:`Engine.check_feasible`
rejects demands only a down node could serve. Grants already held on the
node are still released through the wrapper into the inner manager's books,
so ``free + allocated == capacity`` and the engine's leak check keep holding
while it is down, and a node that returns comes back with clean books.
A node that is back may stay *held* until what its outage left there is
cleaned up: its pools are reported whole but with nothing free, so demands
that fit it are still accepted (and wait) while the policy places nothing there.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from tangram.core.model import Action
from tangram.managers.base import AllocationError, ResourceManager
from tangram.core.pools import PoolState


class DownNodes:
    """The nodes currently down (shared by the gates and the cluster runtime)."""

    def __init__(self) -> None:
        self._down: dict[str, str] = {}  # node -> why
        self._held: set[str] = set()  # up again, but unscheduled until what was left on it is cleaned

    def hold(self, node: str) -> None:
        self._held.add(node)

    def release(self, node: str) -> bool:
        """True if ``node`` was held."""
        held = node in self._held
        self._held.discard(node)
        return held

    def hidden(self, node: str) -> bool:
        """Down, or back but held: the policy must not place on it."""
        return node in self._down or node in self._held

    def mark_down(self, node: str, reason: str = "") -> bool:
        """True if the node was up before."""
        if node in self._down:
            return False  # the first reason stays: it is what callers were told
        self._down[node] = reason
        return True

    def mark_up(self, node: str) -> bool:
        """True if the node was down before."""
        return self._down.pop(node, None) is not None

    def reason(self, node: str | None) -> str | None:
        return None if node is None else self._down.get(node)

    def __contains__(self, node: object) -> bool:
        return node in self._down

    def __iter__(self):
        return iter(list(self._down))

    def __len__(self) -> int:
        return len(self._down)


class NodeGate(ResourceManager):
    """A manager whose pools on down nodes are invisible; everything else is delegated."""

    def __init__(self, inner: ResourceManager, down: DownNodes):
        self.inner = inner
        self.down = down

    def pool_states(self) -> Iterable[PoolState]:
        down = self.down
        return [_full(p) if p.node is not None and down.hidden(p.node) else p
                for p in self.inner.pool_states() if p.node is None or p.node not in down]

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        self._refuse_down(pool)
        return self.inner.allocate(pool, units, holder, action)

    def regrant(self, pool: str, units: int, holder: str, held: int, action: Action | None = None) -> Any:
        self._refuse_down(pool)
        return self.inner.regrant(pool, units, holder, held, action)

    def _refuse_down(self, pool: str) -> None:
        node = pool.partition("@")[2]
        if node and self.down.hidden(node):
            # the policy sees no free unit here; reaching here is a bug, refused before the books move
            raise AllocationError(f"{pool}: node {node!r} is down or not cleaned yet")

    def release(self, pool: str, holder: str) -> bool:
        return self.inner.release(pool, holder)  # down or not: the books must balance

    def check_invariants(self) -> None:
        self.inner.check_invariants()

    def next_wakeup(self, now: float) -> float | None:
        return self.inner.next_wakeup(now)

    def refilled_unseen(self, now: float) -> bool:
        return self.inner.refilled_unseen(now)

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        return self.inner.held()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        # GpuManager.lease/stats, CpuManager.nodes, ...: callers keep using the real manager's API
        return getattr(self.inner, name)


def _full(p: PoolState) -> PoolState:
    """A held node's pool: its capacity counts for feasibility, nothing of it can be placed."""
    return dataclasses.replace(p, free=0, chunks=None if p.chunks is None else (),
                               idle=None if p.idle is None else ())


def gate_all(managers: Iterable[ResourceManager], down: DownNodes) -> list[NodeGate]:
    return [m if isinstance(m, NodeGate) else NodeGate(m, down) for m in managers]
