"""What every executor offers: dumb, asynchronous hands (DESIGN.md §5, §8).

An executor never decides anything: it is told which environment, which
cores / GPU chunk / API slot and which DoP, runs the action, and reports.
Timeouts and cancellation arrive as ``asyncio.CancelledError`` or the
``timeout_s`` argument; the executor must kill what it started *before*
returning, so the caller can give the units back safely.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tangram.core.grants import Grant

SUCCEEDED, FAILED, TIMEOUT, CANCELLED = "succeeded", "failed", "timeout", "cancelled"


@dataclass(slots=True)
class ExecResult:
    """Outcome of one action as the wire API reports it."""

    status: str  # succeeded | failed | timeout | cancelled
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    output: Any = None  # kind-specific (http body, model scores, ...)
    error: str | None = None  # a human-readable reason when not succeeded
    exec_s: float | None = None  # the executor's own measure of the run, without its set-up
    isolation: str | None = None  # how an exec action was confined (cgroup, affinity, docker-cpuset, none)
    node_down: bool = False  # its node died under it: the action did not fail on its own
    truncated: bool = False  # exec: output past the executor's cap was dropped while it streamed
    restored: bool = False  # GPU: the model's state was restored onto the chunk for this run
    restore_s: float = 0.0  # GPU: seconds that restore took
    rate_headers: Mapping[str, str] | None = None  # http: the upstream's rate-limit headers (Retry-After, ...)
    # diagnostics for logs and people (pid, cgroup dirs, container id); nothing in tangram reads them
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and with what an action runs, as decided by the engine and managers."""

    action_id: str
    node: str | None
    dop: int
    cores: Sequence[int] = ()  # CPU actions: the exclusive core set
    cpu_quota: float | None = None  # CPUs worth of CFS quota (defaults to len(cores))
    gpu_devices: Sequence[int] = ()  # GPU actions: the chunk's devices
    grants: Mapping[str, Grant] = field(default_factory=dict)  # pool -> what its manager granted


class EnvironmentExecutor(ABC):
    """Runs ``exec`` actions inside per-trajectory environments (dir or container)."""

    name: str = "abstract"

    @abstractmethod
    async def create_environment(self, env_id: str, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None) -> None:
        """Make the environment (working directory, container); idempotent."""

    @abstractmethod
    async def destroy_environment(self, env_id: str) -> None:
        """Remove it and everything in it; idempotent."""

    @abstractmethod
    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s: float | None = None,
                   env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        """Run ``command`` (``${parallel_num}`` already rendered) pinned to ``placement``;
        ``stdin``: bytes fed to the command's standard input (None: no input)."""

    async def close(self) -> None:
        """Release every environment; idempotent."""

    # stop_grace_s (optional, seconds): how long past ``timeout_s`` a run may take to be killed and reported;
    # the runtime's safety net waits that much more (by default TIMEOUT_GRACE_S) before it gives up on the
    # executor, a result with no exit code and no verdict

    # crash recovery (tangram/service/recover.py): environments outlive the service that made them

    def set_owner(self, owner: str) -> None:
        """Mark what this executor makes as owned by ``owner`` (the state directory's id), so a later run
        with the same state can tell its own leftovers from other services' (shared engines)."""

    async def adopt_environment(self, env_id: str, *, memory_mb: int = 0, network: bool = False) -> bool:
        """Take over an environment a previous run of the service made; False if it is gone."""
        return False

    async def sweep_unrecorded(self, keep: set[str]) -> list[str]:
        """Remove every environment this executor owns that is not in ``keep``; returns their ids."""
        return []

    # node outages (tangram/scaleout/cluster.py): the node's engine died and came back
    outlives_outages: bool = False  # an environment survives its node's engine going down and up (Docker)

    async def reattach_environment(self, env_id: str) -> bool:
        """After an outage of the node: make ``env_id`` usable again; False if it did not survive."""
        return False

    def detach(self) -> None:
        """Forget every environment without removing it (a shutdown that keeps them for the next start)."""


async def wait_through_cancels(fut: asyncio.Future, on_cancel: Callable[[], Any] | None = None) -> bool:
    """Wait until ``fut`` (the work that still holds the action's units: a kill, a worker thread) is done,
    whatever cancels arrive meanwhile (a second DELETE, the shutdown): the caller gives the units back
    once this returns. ``on_cancel`` runs at each (e.g. escalate a kill); True if cancelled meanwhile."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))  # never cancels fut
        except asyncio.CancelledError:
            cancelled = True
            if on_cancel is not None:
                on_cancel()
    return cancelled
