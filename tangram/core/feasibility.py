"""Whether an action can ever run on this cluster, judged on pool capacities alone (never on what is free).

:func:`check` rejects, at submit, a demand no node can ever satisfy (so it is
never queued); :func:`cap_to_capacity` lowers a range's max to the largest
pool that could host it ("as many as you can give"), so the policy never sees
more options than a node holds.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Sequence

from tangram.core.errors import UnschedulableError
from tangram.core.model import Action, Demand
from tangram.policy.snapshot import PoolState, pool_name


def check(action: Action, pools: Mapping[str, PoolState], nodes: Sequence[str], bound: str | None,
          siblings: Sequence[Action] = ()) -> None:
    """Raise :class:`UnschedulableError` naming the field if no node (``bound``: its trajectory's node) ever fits.

    ``siblings``: the waiting CPU actions of its trajectory while it is not placed yet. A trajectory
    runs on one node, and whichever of them starts first places it: a CPU action that no node
    could run together with them would wait for ever once one of them placed it elsewhere."""
    for rtype, demand in action.demands.items():
        if rtype.startswith("api:"):
            p = pools.get(rtype)
            if p is None:
                raise UnschedulableError(f"resources.{rtype}", f"no API pool named {rtype[4:]!r} is configured")
            if demand.min > p.capacity:
                raise UnschedulableError(f"resources.{rtype}", f"needs {demand.min} slots, the pool has {p.capacity}")
    local = [t for t in action.demands if t in ("cpu", "gpu")]
    if not local:
        return
    candidates = (bound,) if bound is not None else nodes
    reasons = []
    for node in candidates:
        why = _node_cannot_host(action, node, pools, bound is None)
        if why is None:
            _check_siblings(action, pools, nodes, siblings if bound is None and "cpu" in action.demands else ())
            return
        reasons.append(why)
    rtype = local[0]
    if not reasons:
        raise UnschedulableError(f"resources.{rtype}", f"no node has a {rtype} pool")
    where = f"trajectory's node {bound!r}" if bound is not None else "any node"
    raise UnschedulableError(f"resources.{reasons[0][0]}", f"{where} can never fit it: {reasons[0][1]}")


def _check_siblings(action: Action, pools: Mapping[str, PoolState], nodes: Sequence[str],
                    siblings: Sequence[Action]) -> None:
    if not siblings or _hosting_all([action, *siblings], nodes, pools):
        return
    # name the first sibling it cannot share any node with (else all of them: only together they exclude it)
    apart = [s for s in siblings if not _hosting_all([action, s], nodes, pools)][:1] or siblings
    ids = ", ".join(repr(s.id) for s in apart)
    raise UnschedulableError(
        "trajectory", f"no node can run it together with its trajectory's waiting action(s) {ids}: a trajectory "
        f"runs on one node, so one of them would wait for ever")


def cap_to_capacity(action: Action, pools: Mapping[str, PoolState]) -> Action:
    """``action`` with every demand's max lowered to the largest pool that could host it.

    A range like ``{"min": 1, "max": 1000000}`` means "as many as you can give":
    the policy then sees at most a node's worth of options, whatever was asked.
    """
    capped: dict[str, Demand] = {}
    for rtype, d in action.demands.items():
        caps = [p.capacity for p in pools.values() if p.rtype == rtype]
        if not caps:
            continue
        c = d.capped(max(caps))
        if c is not None and c is not d:
            capped[rtype] = c
    if not capped:
        return action
    demands = {**action.demands, **capped}
    elastic = [t for t, d in demands.items() if d.elastic]
    return dataclasses.replace(action, demands=MappingProxyType(demands), key=elastic[0] if elastic else None)


def hostable_nodes(actions: Sequence[Action], nodes: Sequence[str], pools: Mapping[str, PoolState]) -> tuple | None:
    """The nodes that could ever run every one of an unplaced trajectory's waiting CPU ``actions``
    (cores, GPUs, memory), where fewer than all; None when every node or none could.

    Placing the trajectory by one of them binds the others to that node: elsewhere one
    could never run, and would wait for ever (the policy reads this as Snapshot.hostable).
    """
    ok = _hosting_all(actions, nodes, pools)
    return ok if ok and len(ok) < len(nodes) else None


def _hosting_all(actions: Sequence[Action], nodes: Sequence[str], pools: Mapping[str, PoolState]) -> tuple[str, ...]:
    """The nodes that could ever run every one of ``actions``, placing a trajectory's memory."""
    return tuple(n for n in nodes if all(_node_cannot_host(a, n, pools, True) is None for a in actions))


def _node_cannot_host(action: Action, node: str, pools: Mapping[str, PoolState], unplaced: bool) -> tuple[str, str] | None:
    for rtype in ("cpu", "gpu"):
        d = action.demands.get(rtype)
        if d is None:
            continue
        p = pools.get(pool_name(rtype, node))
        if p is None:
            return rtype, f"node {node!r} has no {rtype} pool"
        if d.min > p.capacity:
            return rtype, f"needs at least {d.min}, node {node!r} has {p.capacity}"
    if unplaced and "cpu" in action.demands and action.mem_mb:
        p = pools.get(pool_name("mem", node))
        cap = p.capacity if p else 0
        if action.mem_mb > cap:
            return "mem_mb", f"needs {action.mem_mb} MiB, node {node!r} has {cap}"
    return None
