"""The runtime: drives one engine on the event loop with real executors (DESIGN.md §2, §6).

No HTTP here: the service, the demo, the profiler and the verl integration
all drive :class:`Runtime` in-process. The package is split by job:

* :mod:`.actions`: building and validating actions, the result types;
* :mod:`.driver`: :class:`Runtime`, the job table and the engine's event loop;
* :mod:`.dispatch`: placements from grants, the executor of each kind, the timeout net;
* :mod:`.environments`: the registry of trajectories' environments;
* :mod:`.stats`: counts and percentiles.
"""
from tangram.runtime.actions import (
    KINDS,
    ActionOutcome,
    ExecutorFailedError,
    ExecutorMissingError,
    Timing,
    UnknownEnvironmentError,
    build_action,
)
from tangram.runtime.dispatch import TIMEOUT_GRACE_S, Dispatcher, placement_of
from tangram.runtime.driver import Job, Runtime
from tangram.runtime.environments import Environment, Environments
from tangram.runtime.stats import RuntimeStats, percentile

__all__ = [
    "KINDS", "TIMEOUT_GRACE_S", "ActionOutcome", "Dispatcher", "Environment", "Environments",
    "ExecutorFailedError", "ExecutorMissingError", "Job", "Runtime", "RuntimeStats", "Timing",
    "UnknownEnvironmentError", "build_action", "percentile", "placement_of",
]
