"""Whether an event's scheduling round can be skipped: pure checks on what the last round left.

The engine skips a round only where running it would start nothing (docs/scheduling.md,
"What a round reads"); these read the last round's leftovers (``Plan.unfit``) and held groups
(``Plan.holdouts``) and nothing else.
"""
from __future__ import annotations

from typing import Mapping

from tangram.core.model import Action
from tangram.core.queue import lane_pools, lane_uses

_BIG = 1 << 62


def cannot_start(unfit: Mapping[str, int], a: Action, home: str | None, mem: int, nodes) -> bool:
    """Whether the last round's leftovers (``unfit``) shut every pool ``a`` could start in; ``home``:
    the node its trajectory is placed on (None: any of ``nodes``), ``mem``: memory it must place."""
    for rtype, d in a.demands.items():
        if rtype != "cpu" and rtype != "gpu" and unfit.get(rtype, _BIG) <= d.min:
            return True
    local = [(t, d.min) for t, d in a.demands.items() if t == "cpu" or t == "gpu"]
    if not local:
        return False
    for node in ((home,) if home is not None else nodes):
        if all(unfit.get(f"{t}@{node}", _BIG) > u for t, u in local) and (
                not mem or unfit.get(f"mem@{node}", _BIG) > mem):
            return False
    return True


def moves_a_choice(unfit: Mapping[str, int], pools, a: Action, home: str | None, arrivals_moved: str | bool) -> bool:
    """Whether the submission of ``a`` (which cannot start) changes what an elastic group read that
    the last round made wait by choice (evicted in part or in full, held or not): such a group's
    pools are the ones missing from ``unfit`` (or released since). It does when it changes their
    node's expected arrivals (``arrivals_moved``: a node, or True for every node) or joins their
    look-ahead: it needs their resource on a node it may use (``home``: where its trajectory is
    placed; None: anywhere)."""
    for pname in pools:
        if pname in unfit:
            continue  # what waits there waits for units: an action behind them changes nothing
        if arrivals_moved is True:
            return True
        rtype, _, node = pname.partition("@")
        if node and node == arrivals_moved:
            return True
        if rtype in a.demands and (not node or home in (None, node)):
            return True
    return False


def release_wakes_nothing(lanes, released) -> bool:
    """After a settled round (the engine checks that): whether a round now would start nothing,
    that is, no waiting lane can use a pool released since.

    Exact, not a heuristic: candidate selection reads only free units, the
    queue and placements, so with none of a lane's pools changed its actions
    fail as they did (free units only shrank), the blocked heads reserve the
    same pools, and the actions submitted since were skipped as unable to start.
    The policy's time-dependent choices (holding out for more units) are
    excluded by requiring a settled round, except the holdouts (Plan.holdouts),
    which the next round would hold again: their pools were not released, and
    their other inputs change only with a release, a round, or an event whose
    round is never skipped when it moves them: a completion that moves the class
    estimate of a class they read (Plan.holdout_classes), a submission that changes
    their expected arrivals or joins their look-ahead (Engine._moves_a_choice), or
    one that changes where its trajectory may be placed (Snapshot.hostable).
    """
    for lane, _ in lanes:
        if lane_uses(lane, released):
            return False
    return True


def replan_scope(lanes, dirty: set[str], nodes, pools) -> tuple[tuple, tuple[str, ...]] | None:
    """When only the ``dirty`` pools changed since the last round (an action queued, units released,
    expected arrivals moved; the engine adds those where that round left something waiting by choice
    outside a holdout): the lanes a round must re-plan and the pools they could use, when a round over
    those lanes alone plans what a full round would; else None.

    The lanes are those that could use a dirty pool, closed over the pools they could use in turn
    (lane_uses, lane_pools). Every other lane uses none of those pools: its actions waited for units
    or in held groups, so the full round reads for it what the last round read and decides as that
    round did (release_wakes_nothing), its held groups keep their inputs, and the lanes re-planned
    read the free units of pools nobody else takes.
    Two more conditions. Some pool other than memory that no lane could use: candidate selection
    stops early once every such pool is shut (schedule.py), and where that can happen the full
    round's look-ahead may differ from a partial round's; an unused pool is never shut. And no GPU
    action waiting: GPU affinity may hold one back for a busy instance of its model by the clock
    (policy/affinity.py), so a settled round is not a fixed point for them.
    """
    all_lanes = [lane for lane, _ in lanes]
    if not _exact_apart(all_lanes, pools):  # first: one pass, and where it fails it fails every time
        return None
    scope: set[str] = set(dirty)
    inside: list = []
    rest = all_lanes
    grew = True
    while grew and rest:
        grew, outside = False, []
        for lane in rest:
            if lane_uses(lane, scope):
                inside.append(lane)
                scope |= lane_pools(lane, nodes)
                grew = True
            else:
                outside.append(lane)
        rest = outside
    if not rest:
        return None
    return tuple(inside), tuple(scope)


def _exact_apart(lanes, pools) -> bool:
    """No GPU action waits and some pool other than memory is one no lane could use."""
    homes, anywhere, other = set(), set(), set()
    for lane in lanes:
        home = lane[0]
        for rtype, _ in lane[2]:
            if rtype == "gpu":
                return False
            if rtype == "cpu" and home is not None:
                homes.add(home)
            elif rtype == "cpu":
                anywhere.add(rtype)
            else:
                other.add(rtype)
    for pname in pools:
        rtype, _, node = pname.partition("@")
        if rtype == "mem":
            continue
        if not node:
            if rtype not in other:
                return True
        elif rtype not in anywhere and not (rtype == "cpu" and node in homes):
            return True
    return False
