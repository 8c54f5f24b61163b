"""Frozen inputs and outputs of the policy.

The engine builds a :class:`Snapshot` from its queue and its managers' pool
states; :func:`tangram.policy.schedule.plan` turns it into a :class:`Plan`;
the engine applies the plan through the managers. Nothing here mutates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from tangram.core.gaps import ARRIVAL_GAPS
from tangram.core.model import Action
from tangram.core.pools import PoolState, pool_name  # re-exported: the policy's input types

__all__ = ["Dispatch", "Plan", "PolicyParams", "PoolState", "Snapshot", "pool_name", "running_ids",
           "upcoming_inputs"]

_EMPTY: Mapping = MappingProxyType({})
# PolicyParams.offered_load_caps' default (the service's config reads it too)
DEFAULT_OFFERED_LOAD_CAPS: Mapping[str, float] = MappingProxyType({"gpu": 0.5})
# PolicyParams.generation_credit's default (the service's config reads it too): 1.5 measured best of
# 0 / 1 / 1.5 on the built-in API workloads (docs/results/README.md, "Credit for a trajectory's generation")
DEFAULT_GENERATION_CREDIT = 1.5
# PolicyParams.arrival_gap's default (the service's config reads it too): "mean" keeps two more of the
# built-in sweep's 30 CPU points at or below every baseline that did all its work than "residual" does;
# "residual" wins where generation is long (docs/results/README.md, "When a trajectory in generation
# is expected")
DEFAULT_ARRIVAL_GAP = "mean"
# [reason] a restart throws away the run so far and the lognormal model of its class is a guess
# about this one run: restart only where it is expected to save a fifth of the time left. Measured on
# the CPU and mixed families with restartable suites (docs/results/README.md, "Restarting a
# straggler wider"): 0.5 restarted too few of the runs that set the step, 1.0 lost up to 13% on some
DEFAULT_RESTART_GAIN = 0.8


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Knobs of the elastic policy (paper: depth 2 or 3 is enough)."""

    depth: int = 2
    lookahead: int = 32
    default_duration_s: float = 1.0
    # per-class caps on the key resource's DoP (chosen by `tangram tune`)
    dop_caps: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    # ablation baseline: every elastic action gets exactly this many units (or its nearest option)
    fixed_dop: int | None = None
    # queue order (tangram.policy.order): "fcfs" (the paper's) or "aging" (submitted + k * expected);
    # aging with k = 4 measured best on mean and p99 ACT across the built-in workloads (docs/results)
    order: str = "aging"
    aging_k: float = 4.0
    # a configured bound on the aging window, in seconds (None: aging_k x expected alone): no action
    # is passed by one submitted more than this after it, whatever its size (tangram.policy.order)
    aging_cap_s: float | None = None
    # seconds by which each ended action of the same trajectory moves an action's key earlier (aging
    # only; tangram.policy.order): trajectories further along finish first, 0 turns it off
    progress_s: float = 0.0
    # seconds by which each second its trajectory has spent in generation (between its actions so
    # far) moves an API action's key earlier (aging only; tangram.policy.order): on a pool of one
    # class of call, trajectories that have generated longest, the likeliest to set the step, go first
    generation_credit: float = DEFAULT_GENERATION_CREDIT
    # GPU affinity window (aging order only): an action whose service has no idle resident instance
    # is considered affinity_k times its restore time later than its key, so queued actions of a
    # resident service claim their instance first (tangram.policy.schedule); 0 turns it off
    affinity_k: float = 4.0
    # count the next actions of a node's trajectories in generation (Snapshot.upcoming) in the ACT
    # estimate, and let an elastic group leave them headroom when the estimate says so (rewards no
    # longer take the cores a shell action asks for a moment later); False: only submitted actions
    expect_arrivals: bool = True
    # when a trajectory in generation is expected (tangram.core.gaps): "residual", the recent
    # generation gaps' mean beyond the time it has been quiet (none expected once quiet longer than
    # every one of them), or "mean", the mean gap after it went quiet (now, once overdue)
    arrival_gap: str = DEFAULT_ARRIVAL_GAP
    # resource type -> factor of the offered-load DoP cap (tangram.policy.offered_load): an elastic
    # action of that key type gets no DoP m with E(m) below factor x the type's offered load at its
    # submission; GPU only by default (on CPU pools it measured worse), {} turns it off
    offered_load_caps: Mapping[str, float] = field(default_factory=lambda: DEFAULT_OFFERED_LOAD_CAPS)
    # an elastic action without a profile gets its class's T1 and elasticity learned from its runs
    # (tangram.core.estimator) once one has ended; False: it runs at its smallest DoP (DESIGN.md §3)
    learn_unprofiled: bool = True
    # restart a straggling run of a ``restartable`` elastic CPU action at a wider DoP, once units of
    # its node are idle, when that is expected to end it in at most this fraction of its expected
    # time left where it is (tangram.policy.restart); 0 turns restarts off
    restart_gain: float = DEFAULT_RESTART_GAIN

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth: must be >= 1, got {self.depth}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead: must be >= 0, got {self.lookahead}")
        if not self.default_duration_s > 0:
            raise ValueError(f"default_duration_s: must be positive, got {self.default_duration_s}")
        if self.order not in ("fcfs", "aging"):
            raise ValueError(f"order: must be 'fcfs' or 'aging', got {self.order!r}")
        if not (0 <= self.aging_k < float("inf")):
            raise ValueError(f"aging_k: must be a finite number >= 0, got {self.aging_k}")
        if self.aging_cap_s is not None and (isinstance(self.aging_cap_s, bool) or not (
                0 <= self.aging_cap_s < float("inf"))):
            raise ValueError(f"aging_cap_s: must be None or a finite number >= 0, got {self.aging_cap_s!r}")
        if isinstance(self.progress_s, bool) or not (0 <= self.progress_s < float("inf")):
            raise ValueError(f"progress_s: must be a finite number >= 0, got {self.progress_s!r}")
        if isinstance(self.generation_credit, bool) or not (0 <= self.generation_credit < float("inf")):
            raise ValueError(f"generation_credit: must be a finite number >= 0, got {self.generation_credit!r}")
        if not (0 <= self.affinity_k < float("inf")):
            raise ValueError(f"affinity_k: must be a finite number >= 0, got {self.affinity_k}")
        if not isinstance(self.expect_arrivals, bool):
            raise ValueError(f"expect_arrivals: must be true or false, got {self.expect_arrivals!r}")
        if self.arrival_gap not in ARRIVAL_GAPS:
            raise ValueError(f"arrival_gap: must be one of {', '.join(ARRIVAL_GAPS)}, got {self.arrival_gap!r}")
        if isinstance(self.restart_gain, bool) or not (0 <= self.restart_gain <= 1):
            raise ValueError(f"restart_gain: must be a number in [0, 1], got {self.restart_gain!r}")
        if not isinstance(self.learn_unprofiled, bool):
            raise ValueError(f"learn_unprofiled: must be true or false, got {self.learn_unprofiled!r}")
        if not isinstance(self.offered_load_caps, Mapping):
            raise ValueError(f"offered_load_caps: must map a resource type to a factor, got {self.offered_load_caps!r}")
        for rtype, factor in self.offered_load_caps.items():
            if not isinstance(rtype, str):
                raise ValueError(f"offered_load_caps: a key must name a resource type, got {rtype!r}")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 <= factor < float("inf")):
                raise ValueError(f"offered_load_caps[{rtype!r}]: must be a finite number >= 0, got {factor!r}")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the policy may look at, at one instant. The engine hands some maps (placement,
    hostable, class estimates) as read-only views of its own state, whole only during the
    synchronous call: a policy reads them then and keeps no reference past it."""

    pools: Mapping[str, PoolState]
    nodes: tuple[str, ...]
    waiting: Sequence[Action]  # FCFS order; the engine passes a read-only view
    # the order key of each waiting action, in the same order (tangram.policy.order); None: unknown,
    # then the GPU affinity window (PolicyParams.affinity_k) has no time scale and is off
    waiting_keys: Iterable[float] | None = None
    placement: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    # trajectory -> node (memory already reserved)
    # pool -> (seconds left, units) of its running actions: the one channel for them
    # (the engine passes a lazy mapping: only the pools the policy arranges are computed)
    running: Mapping[str, Sequence[tuple[float, int]]] = field(default_factory=lambda: _EMPTY)
    # service -> (seconds left, DoP) of its running GPU actions: when its busy resident instances free
    # (GPU affinity weighs waiting for one against a restore); lazy like ``running``
    running_services: Mapping[str, Sequence[tuple[float, int]]] = field(default_factory=lambda: _EMPTY)
    # running average duration per class (the engine's: a live read-only view, see above)
    class_estimates: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    # node -> (seconds until expected, last action) of its trajectories in generation (placed, nothing
    # queued or running), soonest first: their next actions will ask the node for units (lazy, engine-built)
    upcoming: Mapping[str, Sequence[tuple[float, Action]]] = field(default_factory=lambda: _EMPTY)
    params: PolicyParams = field(default_factory=PolicyParams)
    # the previous round's Plan.holdouts (the engine hands them back): a group whose inputs match
    # is made to wait again without its arrangement being recomputed
    holdouts: Mapping[str, tuple] = field(default_factory=lambda: _EMPTY)
    # trajectory (not placed, more than one CPU action waiting) -> the nodes that could ever run
    # every one of them (capacities), where fewer than all: its placement goes to one of those
    hostable: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Start ``action`` now with ``units[rtype]`` units taken from ``pools[rtype]``.

    ``place_mem_mb`` > 0 means the action's trajectory is placed on ``node``
    now and that much memory is reserved for it.
    """

    action: Action
    node: str | None
    units: Mapping[str, int]
    pools: Mapping[str, str]
    place_mem_mb: int = 0
    estimated_s: float | None = None

    @property
    def dop(self) -> int:
        key = self.action.key
        if key is not None:
            return self.units[key]
        return next(iter(self.units.values()), 1)


# the slots' own setters: the frozen dataclass's __init__ calls object.__setattr__ once per field,
# a third of a round's dispatch building
_set_action, _set_node, _set_units, _set_pools, _set_place_mem, _set_estimated = (
    Dispatch.__dict__[f].__set__ for f in ("action", "node", "units", "pools", "place_mem_mb", "estimated_s"))
_new = object.__new__


def new_dispatch(action: Action, node: str | None, units: Mapping[str, int], pools: Mapping[str, str],
                 place_mem_mb: int, estimated_s: float | None) -> Dispatch:
    """``Dispatch(action, node, units, pools, place_mem_mb, estimated_s)``, the same frozen object,
    built without the per-field setattr (the policy builds one per started action)."""
    d = _new(Dispatch)
    _set_action(d, action)
    _set_node(d, node)
    _set_units(d, units)
    _set_pools(d, pools)
    _set_place_mem(d, place_mem_mb)
    _set_estimated(d, estimated_s)
    return d


@dataclass(frozen=True, slots=True)
class Plan:
    """What starts now; ``unfit`` says what could not start after it.

    ``unfit[pool] = u``: after these dispatches no request of ``u`` or more
    units of ``pool`` can start (0: a waiting head reserves the pool). Free
    units only shrink until something is released, so the engine may skip
    the round of a new action all of whose placements hit such a pool.
    """

    dispatches: tuple[Dispatch, ...] = ()
    unfit: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    # pool -> what its elastic group was decided on, for each pool whose whole group this round
    # chose to wait (for units to free, or for expected arrivals): see Snapshot.holdouts
    holdouts: Mapping[str, tuple] = field(default_factory=lambda: _EMPTY)
    # the action classes whose class_estimates the holdouts read: a completion that moves one changes
    # them without a release, and the engine must not skip its round
    holdout_classes: frozenset[str] = frozenset()


def upcoming_inputs(view: Mapping[str, Sequence], node: str) -> tuple:
    """What ``view[node]`` is computed from, without the clock: equal at one instant means equal
    entries. ``(key, ((x, last action), ...))``, or () when none are expected: the engine's view
    gives its gap and each visible quiet trajectory's ``(since, last action)``; another mapping
    None and its entries."""
    inputs = getattr(view, "inputs", None)
    if inputs is not None:
        return inputs(node)
    entries = tuple(view.get(node) or ())
    return (None, entries) if entries else ()


def running_ids(running: Mapping[str, Sequence], pool: str) -> tuple:
    """What identifies the running actions of ``pool``: their ids in start order where the view
    knows them (the engine's), else their entries."""
    ids = getattr(running, "ids", None)
    if ids is not None:
        return ids(pool)
    return tuple(running.get(pool) or ())
