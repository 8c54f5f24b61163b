"""Whether an event's scheduling round can be skipped: pure checks on what the last round left.

The engine skips a round only where running it would start nothing (docs/scheduling.md,
"What a round reads"); these read the last round's leftovers (``Plan.unfit``) and held groups
(``Plan.holdouts``) and nothing else.
"""
from __future__ import annotations

from typing import Mapping

from tangram.core.model import Action

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


def moves_a_holdout(holdouts: Mapping[str, object], a: Action, home: str | None, arrivals_moved: str | bool) -> bool:
    """Whether a submission changes a held group's inputs (Plan.holdouts) although ``a`` cannot
    start: the expected arrivals of its node (``arrivals_moved``: a node, or True for all), or
    its look-ahead, which ``a`` joins when it needs the held pool's resource on a node it may use
    (``home``: where its trajectory is placed, None: anywhere)."""
    if not holdouts:
        return False
    if arrivals_moved is True:
        return True
    for pname in holdouts:
        rtype, _, node = pname.partition("@")
        if node and (node == arrivals_moved or (rtype in a.demands and home in (None, node))):
            return True
        if not node and rtype in a.demands:
            return True
    return False
