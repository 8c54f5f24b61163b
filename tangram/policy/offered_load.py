"""The offered-load DoP cap: under a burst, no elastic action takes more units than the load allows.

When an elastic action is submitted, its DoP is capped at the largest ``m`` of its options
with ``E(m) >= factor x rho``: ``rho`` is the work at smallest DoPs submitted on its resource
type over the last ``T(min)`` seconds (its own duration at its smallest DoP) over what the
type's capacity does in that time (``tangram.core.offered``). At a load ``rho`` the type
can serve every action at DoP ``m`` only while ``rho / E(m) <= 1``; ``factor`` (0.5 by
default) loosens that, since the rate at a burst's start is its peak. An idle type caps
nothing (``rho`` near 0), and the cap is the action's for good (its DoP options are fixed at
submission, as a profile's ``max_dop`` is).

Why at submission and on GPU only (``PolicyParams.offered_load_caps``): the elastic stage
sees the actions already waiting, not those about to come, so in a burst the first arrivals
take the widest DoPs and the rest queue behind them (``docs/results/README.md``, "A DoP cap
from the offered load"). On GPU pools it lowers tangram's losses to the best baseline across
the random family; on CPU pools it loses more than it gains (suites held to a DoP or two by a
burst's opening rate end the step), so it is off there by default.
"""
from __future__ import annotations

from tangram.core.model import Action, Demand


def offered_load_cap(a: Action, rtype: str, load: float | None, factor: float) -> Demand | None:
    """``a``'s demand on ``rtype`` capped for an offered ``load`` (None: no change)."""
    if load is None or factor <= 0.0 or a.elasticity is None:
        return None
    d = a.demands[rtype]
    threshold = factor * load
    options = d.options
    cap = options[0]  # the smallest DoP whatever the load: an action always runs
    for m in options[1:]:
        if a.elasticity.efficiency(m) >= threshold:
            cap = m
    if cap >= d.max:
        return None
    return d.capped(cap)
