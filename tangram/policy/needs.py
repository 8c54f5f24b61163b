"""What candidate selection reads of one action's demands, built once per action.

Every round asks the same questions of each waiting action: which pools it
takes on a node, which API pools, its minimum units. The answers depend only
on the frozen action, so they are kept in a memo (:mod:`tangram.policy.memo`,
like the rows of :mod:`tangram.policy.rows`) instead of being rebuilt by every round.
"""
from __future__ import annotations

from tangram.core.model import Action
from tangram.core.pools import pool_name
from tangram.policy.memo import register, remember


class Needs:
    """One action's demands, split the way :func:`tangram.policy.schedule._place` reads them."""

    __slots__ = ("ref", "local", "api", "not_gpu", "has_cpu", "has_gpu", "scalable", "mins", "shape", "types",
                 "_on")

    def __init__(self, a: Action):
        self.ref = None  # to ``a``, weak (memo.remember)
        demands = a.demands
        self.has_cpu = "cpu" in demands
        self.has_gpu = "gpu" in demands
        self.scalable = a.scalable
        self.types = tuple(demands)  # with the node, all that on() reads
        self._on: dict = {}  # node -> on(node), this action's own: a round asks several times
        if len(demands) == 1:  # most actions: the same fields as below, without the generators
            ((t, d),) = demands.items()
            local = t == "cpu" or t == "gpu"
            self.local = (t,) if local else ()
            self.api = () if local else (t,)
            self.not_gpu = () if t == "gpu" else (t,)
            self.mins = {t: d.min}
            self.shape = ((t, d.lo, d.hi, d.picks),)
            return
        types = self.types
        self.local = tuple(t for t in types if t in ("cpu", "gpu"))  # pools chosen per node
        self.api = tuple(t for t in types if t not in ("cpu", "gpu"))
        self.not_gpu = tuple(t for t in types if t != "gpu")
        self.mins = {t: d.min for t, d in demands.items()}  # copied: a round raises the key's units
        # equal iff the demands are equal, and cheap to hash (a Demand hashes in Python)
        self.shape = tuple((t, d.lo, d.hi, d.picks) for t, d in sorted(demands.items()))

    def on(self, node: str | None) -> tuple[tuple[str, ...], dict[str, str]]:
        """``(pool names of the node-local demands, {rtype: pool name})`` on ``node``.

        The mapping is shared by every action with the same resource types (in
        the same order) on ``node``, in every round: read only (the policy hands
        it out behind a read-only proxy).
        """
        hit = self._on.get(node)
        if hit is None:
            key = (self.types, node)
            hit = _ON.get(key)
            if hit is None:
                if len(_ON) >= 65536:
                    _ON.clear()
                pools = {t: pool_name(t, node) for t in self.types}
                hit = _ON[key] = (tuple(pools[t] for t in self.local), pools)
            self._on[node] = hit
        return hit


# (resource types, node) -> Needs.on's answer: a handful of type tuples times the nodes, where
# one per action and node cost 2% of a large simulation (the same pool names built again)
_ON: dict[tuple, tuple[tuple[str, ...], dict[str, str]]] = {}


_NEEDS: dict[int, Needs] = register({})  # id(action) -> its Needs, while the action waits (policy.memo)


def needs(a: Action) -> Needs:
    """The memo entry of ``a``."""
    hit = _NEEDS.get(id(a))
    if hit is not None:
        return hit
    return remember(_NEEDS, a, Needs(a))
