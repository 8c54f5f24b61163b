"""The order in which waiting actions are considered (DESIGN.md §4).

A pure function of one action and the estimates at its submission: the key
is fixed per action, so the engine keeps its queue sorted once, on insert,
and a round reads a prefix of it (candidate selection stays O(candidates)).

* ``fcfs``  — arrival order, the paper's Algorithm 1.
* ``aging`` — ``submitted_at + aging_k * expected_s``: shortest-expected-first
  among actions that arrived close together, FCFS across longer spans. An
  action ``a`` can only be passed by actions submitted before
  ``submitted_at(a) + aging_k * expected_s(a)``; any later arrival sorts
  behind it. With a blocked head reserving its pools, ``a``'s wait is thus
  bounded by the work submitted in a window of ``aging_k`` times its own
  expected duration, which is what makes the order starvation-free.
  ``aging_cap_s`` (PolicyParams, off by default) caps that window in
  seconds: no action is passed by one submitted more than ``aging_cap_s``
  after it, so the longest actions trade some of the mean for their tail.
  ``progress_s`` (off by default) moves the key that many seconds earlier per
  ended action of the same trajectory (counted by the engine at submission),
  so trajectories further along finish first.
  ``generation_credit`` (1.5 by default, 0 turns it off) moves an API action's key that many
  seconds earlier per second its trajectory has spent in generation so far
  (the engine's count at submission). An API pool serves one class of call,
  where the size-based window orders nothing and the pool is shared evenly
  over trajectories; the credit lets the trajectories that have generated
  longest go first, the ones most likely to set the step. Either credit
  widens the starvation bound above by the most credit a passer can have
  (docs/scheduling.md, "Order").
"""
from __future__ import annotations

from typing import Mapping

from tangram.core.model import Action, is_api_type

ORDERS = ("fcfs", "aging")


def expected_s(a: Action, class_estimates: Mapping[str, float], default_s: float, *, fastest: bool = False) -> float:
    """Expected execution time of ``a``: its profile at its minimum units (``fastest``: at
    its largest), or its class's running average."""
    if a.t1_s is not None:
        if a.scalable:
            d = a.demands[a.key]
            return a.duration(d.max if fastest else d.min)
        return a.t1_s
    return class_estimates.get(a.action_class, default_s)


def order_key(a: Action, submitted_at: float, order: str, aging_k: float,
              class_estimates: Mapping[str, float], default_s: float, aging_cap_s: float | None = None,
              progress_s: float = 0.0, done: int = 0, generation_credit: float = 0.0,
              generated_s: float = 0.0) -> float:
    """Sort key of a waiting action (ties are broken by arrival by the caller); ``done``: how many
    actions of its trajectory have ended, each worth ``progress_s`` seconds earlier (aging only);
    ``generated_s``: the seconds its trajectory has spent in generation, each worth
    ``generation_credit`` seconds earlier if ``a`` calls an API (aging only)."""
    if order == "fcfs":
        return submitted_at
    window = aging_k * expected_s(a, class_estimates, default_s)
    if aging_cap_s is not None and window > aging_cap_s:
        window = aging_cap_s
    key = submitted_at + window - progress_s * done
    if generation_credit and generated_s and calls_api(a):
        key -= generation_credit * generated_s
    return key


def calls_api(a: Action) -> bool:
    """Whether ``a`` holds a slot of an API pool (the actions ``generation_credit`` applies to)."""
    return any(is_api_type(r) for r in a.demands)


def params_key(a: Action, submitted_at: float, params, class_estimates: Mapping[str, float], done: int = 0,
               generated_s: float = 0.0) -> float:
    """:func:`order_key` with the order's knobs read from ``params`` (a PolicyParams)."""
    return order_key(a, submitted_at, params.order, params.aging_k, class_estimates, params.default_duration_s,
                     params.aging_cap_s, params.progress_s, done, params.generation_credit, generated_s)
