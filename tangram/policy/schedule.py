"""One scheduling round (paper Algorithm 1, DESIGN.md §4).

1. FCFS candidates: walk the queue, take every action whose minimum demands
   fit together with the earlier candidates' (vector constraint, topology
   aware); an action that does not fit blocks the pools it needs (on its
   node, or on the one node it reserves when it could go anywhere), so later
   actions never overtake it there (no starvation) while actions that need
   other pools or nodes go on (an API call never waits behind a test suite).
2. Group the scalable candidates by key pool; the rest get their minimum.
3. Greedy eviction per group with the ACT approximation (Algorithm 2, estimate.py) over
   the DPArrange prefix table (one DP pass serves every prefix): elastic.py.
"""
from __future__ import annotations

from types import MappingProxyType

from tangram.core.model import Action
from tangram.policy.affinity import Affinity, affinity_order
from tangram.policy.arrange import packable
from tangram.policy.elastic import elastic_allocation
from tangram.policy.needs import Needs
from tangram.policy.needs import _NEEDS
from tangram.policy.needs import needs as _needs
from tangram.policy.node_rank import NodeRank
from tangram.policy.rows import run_estimate
from tangram.policy.snapshot import Plan, Snapshot, new_dispatch, pool_name



class _Candidate:
    __slots__ = ("action", "node", "pools", "units", "place_mem", "hits", "group", "slot")

    def __init__(self, action: Action, node: str | None, pools: dict[str, str], units: dict[str, int], place_mem: int,
                 hits: frozenset[int], scalable: bool, slot: int):
        self.slot = slot  # its index in the round's candidate list (elastic.py sets it to None there when evicted)
        self.action = action
        self.node = node
        self.pools = pools  # rtype -> pool name
        self.units = units
        self.place_mem = place_mem
        self.hits = hits  # GPU DoPs at which an idle instance of its service is its to take (no restore)
        self.group = pools[action.key] if scalable else None  # its elastic group: its key pool


def _base_units(a: Action, nd: Needs, snap: Snapshot, placed) -> dict[str, int]:
    """Minimum of every demand; under the fixed-DoP baseline, N (or the nearest option below) for the
    key, and no more than the key pool of its trajectory's node holds: a trajectory placed on a
    smaller node would otherwise wait forever for units its node does not have."""
    units = dict(nd.mins)
    if a.key is not None:
        n = snap.params.fixed_dop
        home = (snap.placement.get(a.trajectory) or placed.get(a.trajectory)) if (
            nd.has_cpu and a.trajectory is not None) else None
        if home is not None and a.key in nd.local:
            key_pool = snap.pools.get(pool_name(a.key, home))
            n = min(n, key_pool.capacity) if key_pool is not None else n
        opts = a.demands[a.key].options
        units[a.key] = max((o for o in opts if o <= n), default=opts[0])
    return units


def plan(snap: Snapshot) -> Plan:
    """Decide what starts now, where, and with how many units."""
    if not snap.waiting:
        return Plan()
    cands, lookahead, unfit = _select_candidates(snap)
    if not cands:
        return Plan(unfit=MappingProxyType(unfit))
    chosen = list(cands)
    holdouts, holdout_classes = elastic_allocation(snap, cands, lookahead)
    for c, kept in zip(chosen, cands):
        if kept is None:  # evicted: the units it would have taken stay free
            for pname in c.pools.values():
                unfit.pop(pname, None)
            if c.place_mem:
                unfit.pop(pool_name("mem", c.node), None)
                _hand_on_placement(c, cands)
    return Plan(unfit=MappingProxyType(unfit), holdouts=MappingProxyType(holdouts), holdout_classes=holdout_classes,
                dispatches=tuple([
        new_dispatch(
            c.action,
            c.node,
            MappingProxyType(c.units),  # the candidate's own dict: nothing else holds it
            MappingProxyType(c.pools),  # shared by every action of the same types on this node (Needs.on): read only
            c.place_mem,
            run_estimate(c.action, c.units, c.hits, snap),
        )
        for c in cands
        if c is not None
    ]))


def _hand_on_placement(evicted: _Candidate, cands: list) -> None:
    """An evicted candidate that placed its trajectory hands the memory on to the first kept action
    of that trajectory: those were bound to its node by it, and one that started would otherwise
    place the trajectory there with no memory reserved."""
    t = evicted.action.trajectory
    if t is None:
        return
    for c in cands:
        if c is not None and c.action.trajectory == t and c.node == evicted.node and "cpu" in c.units:
            c.place_mem = evicted.place_mem
            return


# --------------------------------------------------------------------------- #
# 1. candidates


def _select_candidates(snap: Snapshot):
    pools = snap.pools
    free = _Free(pools)
    taken_chunks: dict[str, list[int]] = {}  # chunked (GPU) pool -> the units this round's candidates take
    blocked: set[str] = set()
    placed: dict[str, str] = {}  # trajectories placed by this round
    cands: list[_Candidate] = []
    lookahead: dict[str, list[Action]] = {}
    limit = snap.params.lookahead
    closed: set[str] = set()  # blocked, or too full for even one unit: nothing more starts there
    blockable = None  # the pools but memory, once a head blocks
    # free units only shrink within a round: once u units did not fit in a pool, nothing of u or more will
    failed_at: dict[str, int] = {}
    failed_shapes: dict[tuple, list[str]] = {}  # see _shape -> the pools it waits behind
    # unplaced trajectories whose first CPU action in queue order could not be placed -> the pools it
    # waits behind: the first one places the trajectory, so its later CPU actions wait behind it
    unplaced_waiting: dict[str, list[str]] = {}

    def fits(pname: str, units: int) -> bool:
        failed = failed_at.get(pname)
        if failed is not None and units >= failed:
            return False
        ok = free[pname] >= units
        if ok and pools[pname].chunks is not None:  # a GPU pool: the request must pack with this round's
            ok = packable(pools[pname].chunks, taken_chunks.get(pname, []) + [units])
        if not ok:
            failed_at[pname] = units
            if units <= 1:
                closed.add(pname)
        return ok

    # id -> a shape's list of pools (failed_shapes) every look-ahead of which is full, kept alive here
    # so that its id stays its own: the list may name a pool on every node (_waits_for), and each
    # action of that shape behind the head reads it
    full: dict[int, list[str]] = {}

    def wait_behind(a: Action, pnames, kept: bool = False) -> None:
        """``a`` waits behind the blocked heads of ``pnames``: the ACT estimate's look-ahead.
        ``kept``: ``pnames`` is a list this round reads again (a shape's)."""
        if kept and id(pnames) in full:
            return
        room = False
        for pname in pnames:
            waiting = lookahead.setdefault(pname, [])
            if len(waiting) < limit:
                waiting.append(a)
                room = room or len(waiting) < limit
        if kept and not room:  # look-aheads only grow within a round
            full[id(pnames)] = pnames

    nodes = snap.nodes if type(snap.nodes) is tuple else tuple(snap.nodes)  # a memo key
    gpu_pools = [g for g in _gpu_pool_names(nodes) if g in pools]
    affinity = Affinity({g: pools[g] for g in gpu_pools})  # resident instances live on GPU pools only
    waiting_iter = affinity_order(snap, affinity, gpu_pools, closed)
    elastic = snap.params.fixed_dop is None  # else the fixed-DoP baseline's units (_base_units)
    needs_memo = _NEEDS
    only_node = snap.nodes[0] if len(snap.nodes) == 1 and snap.nodes[0] is not None else None
    placement, hostable = snap.placement, snap.hostable
    rank = NodeRank(nodes, pools, free) if len(nodes) > 1 else None
    for a in waiting_iter:
        nd = needs_memo.get(id(a))  # needs(a), its memo read inline (once per waiting action read)
        if nd is None:
            nd = _needs(a)
        traj = a.trajectory
        # the node its trajectory is bound to, by an earlier round or this one (CPU actions only)
        bound = (placement.get(traj) or placed.get(traj)) if (traj is not None and nd.has_cpu) else None
        if closed and not nd.has_cpu and all(t in closed for t in nd.not_gpu) and (
                not nd.has_gpu or all(g in closed for g in gpu_pools)):
            # fast path, same outcome as _place: an action (API and/or GPU) behind blocked heads
            # of every pool it could use only joins their look-ahead (a long backlog otherwise
            # made every round O(queue) calls of _place)
            wait_behind(a, [*(gpu_pools if nd.has_gpu else ()), *nd.not_gpu])
            continue
        if closed and bound is not None:
            # fast path: a trajectory pinned to a node whose pools are all shut this round
            at_home = nd.on(bound)[1].values()  # pool_name(t, bound) of every demand
            if closed.issuperset(at_home):
                wait_behind(a, list(at_home))
                continue
        if unplaced_waiting and nd.has_cpu and traj in unplaced_waiting:
            # placing it elsewhere would bind the earlier action there too: its reservation would
            # move (a round later something else starts) or it would be bound to a node that cannot run it
            wait_behind(a, unplaced_waiting[traj], kept=True)
            continue
        shape = None
        if failed_shapes:
            shape = _shape(a, nd, bound, hostable)
            needed = failed_shapes.get(shape)
            if needed is not None:
                # fast path: one of the same shape could not start this round, and free
                # units only shrink (a queue of unplaced trajectories waiting for memory)
                wait_behind(a, needed, kept=True)
                if bound is None and nd.has_cpu and traj is not None:
                    unplaced_waiting.setdefault(traj, needed)
                continue
        units = dict(nd.mins) if elastic else _base_units(a, nd, snap, placed)
        home = None
        if not nd.api:
            if a.trajectory is not None and nd.has_cpu:
                home = snap.placement.get(a.trajectory)
            elif only_node is not None and nd.local and not (nd.has_cpu and a.mem_mb):
                home = only_node  # one node, and nothing to place: _place would look at it alone
        on = None  # the home node's Needs.on, read once for the fit and the candidate's pools
        if home is not None and _open_and_fit((on := nd.on(home))[0], nd.local, units, pools, blocked, fits):
            node, place_mem = home, 0  # fast path, as _place decides it: the action fits on its one node
        else:
            node, needed, place_mem = _place(a, nd, units, snap, placed, free, fits, blocked, affinity, rank)
            on = None  # placed elsewhere, or nowhere
        if node is _NO_NODE:
            shape = shape or _shape(a, nd, bound, hostable)
            ahead = _waits_for(a, nd, bound, needed, units, free, snap)
            failed_shapes[shape] = ahead
            if shape[0] is None and nd.has_cpu and a.trajectory is not None:  # an unplaced trajectory's
                unplaced_waiting.setdefault(a.trajectory, ahead)
            blocked.update(needed)
            closed.update(needed)
            wait_behind(a, ahead, kept=True)
            # memory is only ever needed along with cores: once every other pool has a
            # blocked head, nothing later in the queue can start this round
            if blockable is None:
                blockable = {name for name, p in pools.items() if p.rtype != "mem"}
            if blockable <= closed:  # every pool is blocked or full: nothing later can start
                _fill_lookahead(waiting_iter, lookahead, limit, snap, placed)
                break
            continue
        pools_of = (on or nd.on(node))[1]
        for t, u in units.items():
            pname = pools_of[t]
            free[pname] -= u
            if pools[pname].chunks is not None:
                taken_chunks.setdefault(pname, []).append(u)
        if place_mem:
            free[pool_name("mem", node)] -= place_mem
        if rank is not None and node is not None:
            rank.moved(node)
        if node is not None and nd.has_cpu and a.trajectory is not None:
            placed.setdefault(a.trajectory, node)
        hits = affinity.claim(pools_of["gpu"], a) if "gpu" in pools_of and a.service is not None else _NO_HITS
        cands.append(_Candidate(a, node, pools_of, units, place_mem, hits, nd.scalable, len(cands)))
    # a request above what is left after these candidates cannot fit either (the
    # elastic stage only adds units; evicted candidates' pools are dropped later)
    unfit = {pname: p.free + 1 for pname, p in pools.items()}
    unfit.update((pname, f + 1) for pname, f in free.items())
    # a failure lowers this only in a chunked pool (u units free that did not pack): elsewhere u did not
    # fit in units free then, no fewer than now, so u >= free + 1 already (memory a trajectory could not
    # place, the same case, is not recorded at all)
    for pname, u in failed_at.items():
        if u < unfit[pname]:
            unfit[pname] = u
    unfit.update((pname, 0) for pname in closed)
    return cands, lookahead, unfit


class _Free(dict):
    """Free units per pool as this round's candidates take them. A pool's entry is read from the
    snapshot when first asked for: a round touches a few of a cluster's pools."""

    __slots__ = ("_pools",)

    def __init__(self, pools):  # an empty dict already: dict.__init__ would only add arguments
        self._pools = pools

    def __missing__(self, name: str) -> int:
        free = self[name] = self._pools[name].free
        return free


_GPU_POOL_NAMES: dict[tuple, tuple[str, ...]] = {}


def _gpu_pool_names(nodes: tuple) -> tuple[str, ...]:
    """``pool_name("gpu", n)`` of every node, kept per node tuple (every round asks)."""
    hit = _GPU_POOL_NAMES.get(nodes)
    if hit is None:
        if len(_GPU_POOL_NAMES) >= 64:
            _GPU_POOL_NAMES.clear()
        hit = _GPU_POOL_NAMES[nodes] = tuple(pool_name("gpu", n) for n in nodes)
    return hit


def _shape(a: Action, nd: Needs, bound: str | None, hostable) -> tuple:
    """What decides whether ``a`` fits: its demands, its home node (``bound``: the node its
    trajectory is bound to, for a CPU action), or the memory it must place (and the nodes it may
    be placed on, Snapshot.hostable)."""
    if not nd.has_cpu:
        return None, 0, nd.shape
    if bound is None and hostable and a.trajectory in hostable:
        return None, a.mem_mb, nd.shape, hostable[a.trajectory]
    return bound, a.mem_mb if bound is None else 0, nd.shape


def _waits_for(a: Action, nd: Needs, bound, needed: list[str], units: dict[str, int], free,
               snap: Snapshot) -> list[str]:
    """The pools whose look-ahead a head that fits nowhere joins: those it blocks (the node it
    reserves) and, for an action free to go to other nodes too, the same pools on every node that
    could ever host it: it starts on whichever frees first, so each node's estimate counts it."""
    if bound is not None or not nd.has_cpu or nd.has_gpu or len(snap.nodes) < 2:
        return needed
    local = nd.local
    reserved = [p for p in needed if p.partition("@")[0] in local]
    if not reserved:  # a trajectory waiting for memory only: its cores are not what it waits for
        return needed
    if len(reserved) == len(local) and all(free[p] >= units[p.partition("@")[0]] for p in reserved):
        return needed  # its cores fit where it waits: an API pool or memory holds it, not cores
    nodes = snap.hostable.get(a.trajectory, snap.nodes) if a.trajectory is not None else snap.nodes
    more = [p for n in nodes if _could_host(a, units, local, n, snap)
            for p in nd.on(n)[0] if p not in needed]
    return needed + more if more else needed


def _could_host(a: Action, units: dict[str, int], local, node, snap: Snapshot) -> bool:
    """Whether ``node`` has the capacity to run ``a`` ever: its node-local pools hold its units, and
    one memory pool its trajectory's memory when the trajectory is still to be placed."""
    for t in local:
        p = snap.pools.get(pool_name(t, node))
        if p is None or p.capacity < units[t]:
            return False
    if "cpu" in a.demands and a.mem_mb and a.trajectory not in snap.placement:
        m = snap.pools.get(pool_name("mem", node))
        if m is None or m.capacity < a.mem_mb:
            return False
    return True


def _fill_lookahead(rest, lookahead: dict[str, list[Action]], limit: int, snap: Snapshot, placed) -> None:
    """Queue the next ``limit`` actions behind the blocked heads for the ACT estimate."""
    by_type: dict[str, list[tuple[str, list[Action]]]] = {}
    for pname, lst in lookahead.items():
        rtype, _, node = pname.partition("@")
        by_type.setdefault(rtype, []).append((node, lst))
    for _, a in zip(range(limit), rest):
        # as _place binds it: a placed trajectory's action waits only behind its own node's heads
        home = (snap.placement.get(a.trajectory) or placed.get(a.trajectory)) if (
            a.trajectory is not None and "cpu" in a.demands) else None
        for t in a.demands:
            for node, lst in by_type.get(t, ()):
                if len(lst) < limit and (home is None or not node or node == home):
                    lst.append(a)


_NO_HITS: frozenset[int] = frozenset()  # a candidate with no idle GPU instance to take


class _NoNode:
    pass


_NO_NODE = _NoNode()


def _place(a: Action, nd: Needs, units: dict[str, int], snap: Snapshot, placed, free, fits, blocked, affinity,
           rank: NodeRank | None = None):
    """Choose the node for ``a``: returns (node, pools it would block, memory to place).

    A trajectory stays on the node its first CPU action was placed on; an
    unplaced one goes to a node with cores for the action and memory for the
    whole trajectory, the one with the most free memory (load balancing).
    """
    pools = snap.pools
    api_pools = nd.api
    for t in api_pools:
        if t not in pools:
            return _NO_NODE, [], 0  # its pool vanished (e.g. reconfigured); it waits
    local = nd.local
    if not local:
        ok = all(t not in blocked and fits(t, units[t]) for t in api_pools)
        return (None, [], 0) if ok else (_NO_NODE, list(api_pools), 0)

    bound = None
    nodes = snap.nodes
    if nd.has_cpu and a.trajectory is not None:
        bound = snap.placement.get(a.trajectory) or placed.get(a.trajectory)
        # an unplaced trajectory goes only where all its waiting CPU actions could run (Snapshot.hostable)
        nodes = (bound,) if bound is not None else snap.hostable.get(a.trajectory, nodes)
    api_ok = True
    for t in api_pools:
        if t in blocked or not fits(t, units[t]):
            api_ok = False
            break
    best, best_key = _NO_NODE, None
    place_mem = a.mem_mb if (bound is None and nd.has_cpu) else 0
    scan = nodes
    # a CPU action free to go to any node (``nodes is snap.nodes``: none bound, no hostable restriction)
    # that takes no GPU: the ranking stands in for the scan (node_rank.py)
    if rank is not None and nd.has_cpu and not nd.has_gpu and nodes is snap.nodes and units["cpu"] >= 1:
        order = rank.ranked()
        if order is not None:
            best = _ranked_fit(order, rank, nd, units, place_mem, pools, blocked, fits, free)
            scan = ()  # decided
    for node in scan:
        if not _open_and_fit(nd.on(node)[0], local, units, pools, blocked, fits):
            continue
        if place_mem and not _holds_memory(node, place_mem, pools, blocked, free):
            continue
        if len(nodes) == 1:
            best = node  # nothing to prefer it to
            break
        key = _node_preference(a, node, snap, free, affinity)
        if best_key is None or key > best_key:
            best, best_key = node, key
    if best is _NO_NODE or not api_ok:
        if best is _NO_NODE:
            best = _reservation_node(a, units, local, nodes, snap, free)
        # Head-of-line blocking per node: the waiting head reserves one node (later
        # actions may not take its units there), the other nodes keep serving.
        targets = nodes if best is _NO_NODE else (best,)
        block = [pool_name(t, n) for n in targets for t in local if pool_name(t, n) in snap.pools]
        if bound is None and "cpu" in a.demands and a.mem_mb:
            mem_pools = [pool_name("mem", n) for n in targets if pool_name("mem", n) in snap.pools]
            if best is not _NO_NODE and all(free[m] < a.mem_mb or m in blocked for m in mem_pools):
                # A trajectory waiting for memory reserves the memory only: memory frees
                # only as trajectories end, and the cores and API slots meanwhile serve the
                # trajectories already placed (one whose next call it held back could never
                # end to free the memory). Once the memory is there it reserves them all.
                return _NO_NODE, mem_pools, 0
            block += mem_pools
        return _NO_NODE, block + list(api_pools), 0
    return best, [], place_mem


def _ranked_fit(order: list[tuple], rank: NodeRank, nd: Needs, units: dict[str, int], place_mem: int, pools,
                blocked, fits, free):
    """The node _place's scan picks for a CPU action free to go anywhere: the first in rank order
    (``order``, node_rank.py) that fits it and, when it places its trajectory (``place_mem``), its
    memory. ``fits``' record is the scan's: an unchunked pool the ranking does not reach is one where
    the action fits, or does not and the record only says so again (free units only shrink within a
    round; see the end of _select_candidates), except a pool out of cores, which a one-core action
    closes."""
    local = nd.local
    best = _NO_NODE
    for entry in order:
        node = entry[3]
        if _open_and_fit(nd.on(node)[0], local, units, pools, blocked, fits) and (
                not place_mem or _holds_memory(node, place_mem, pools, blocked, free)):
            best = node
            break
    if units["cpu"] == 1:
        for name in rank.take_out_of_cores():
            if name not in blocked:  # a blocked pool is closed already
                fits(name, 1)  # closes it, as the scan does
    return best


def _holds_memory(node, place_mem: int, pools, blocked, free) -> bool:
    """``node``'s memory pool can place ``place_mem`` now."""
    mname = pool_name("mem", node)
    return mname in pools and mname not in blocked and free[mname] >= place_mem


def _open_and_fit(names, types, units, pools, blocked, fits) -> bool:
    """Every one of ``names`` exists and is not blocked, and then each fits its type's units."""
    for n in names:
        if n not in pools or n in blocked:
            return False
    for n, t in zip(names, types):
        if not fits(n, units[t]):
            return False
    return True


def _reservation_node(a: Action, units: dict[str, int], local: list[str], nodes, snap: Snapshot, free):
    """The node a head that fits nowhere waits for: the one closest to fitting it.

    Closest = the fewest missing units of its node-local demands (memory
    included for a trajectory still to be placed), then the most free units.
    While reserved, a node only gains free units, so the reservation moves
    only to a node that is strictly closer: the head cannot starve.
    """
    best, best_key = _NO_NODE, None
    for node in nodes:
        if not _could_host(a, units, local, node, snap):
            continue  # this node can never host it
        names = [pool_name(t, node) for t in local]
        missing = sum(max(0, units[t] - free[n]) for n, t in zip(names, local))
        if "cpu" in a.demands and a.mem_mb and a.trajectory not in snap.placement:
            missing += 1 if free[pool_name("mem", node)] < a.mem_mb else 0
        key = (-missing, sum(free[n] for n in names))
        if best_key is None or key > best_key:
            best, best_key = node, key
    return best


def _node_preference(a: Action, node: str, snap: Snapshot, free, affinity: Affinity) -> tuple:
    if "gpu" in a.demands:
        gp = snap.pools[pool_name("gpu", node)]
        # an idle instance of its service to take (a cache hit), then the most free GPUs
        return (affinity.has(gp.name, a), free[gp.name])
    mname = pool_name("mem", node)
    mem_free = free[mname] if mname in snap.pools else 0
    return (mem_free, free[pool_name("cpu", node)])
