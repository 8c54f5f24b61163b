"""Errors of the simulator's inputs (they name the offending YAML field)."""
from __future__ import annotations

from tangram.core.errors import DemandError


class WorkloadError(DemandError):
    """A workload, cluster or policy name is malformed or unknown."""
