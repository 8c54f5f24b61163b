"""Simulated GPU executor: the torch executor's timing, without torch or GPUs.

For the simulator, which runs the engine on a virtual clock: :meth:`run`
returns how long evicting, restoring and inferring *would* take instead of
sleeping; :meth:`execute` is the same with a real (or injected) sleep, for
driving the real service against simulated hardware.

Model, per node:

* each GPU has ``memory_mb_per_gpu``; the executor mirrors what is resident
  (following the manager's decisions) and asserts it never overflows, so a
  bookkeeping bug shows up as an error, not as optimistic timings;
* a restore copies ``restore_mb_per_device`` to every device of the chunk in
  parallel (one host link per GPU) at ``restore_gbps`` GB/s, plus a fixed
  ``restore_overhead_s`` (allocator, kernel warm-up);
* inference is data-parallel: ``ceil(n / (batch_size * dop))`` batches of
  ``batch_latency_s`` each, unless the caller passes ``exec_s`` (e.g. the
  action's profiled duration at that DoP).
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Awaitable, Callable

from tangram.core.grants import CacheDecision, restore_seconds



@dataclass(frozen=True, slots=True)
class SimGpuParams:
    memory_mb_per_gpu: int = 80 * 1024
    restore_gbps: float = 20.0  # host-to-device from pinned memory, per GPU
    restore_overhead_s: float = 0.0
    batch_latency_s: float = 0.05
    batch_size: int = 32

    def __post_init__(self) -> None:
        if not self.restore_gbps > 0:
            raise ValueError(f"restore_gbps: must be positive, got {self.restore_gbps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.batch_latency_s < 0 or self.restore_overhead_s < 0:
            raise ValueError("latencies must be non-negative")


@dataclass(frozen=True, slots=True)
class SimTiming:
    """What one action costs: restore (0 on a hit) then execution."""

    restore_s: float
    exec_s: float
    hit: bool
    evicted: tuple[str, ...] = ()

    @property
    def total_s(self) -> float:
        return self.restore_s + self.exec_s


class SimulatedGpuExecutor:
    """Mirrors residency and device memory of one node; returns durations."""

    name = "simulated-gpu"

    def __init__(self, num_gpus: int, params: SimGpuParams | None = None):
        self.num_gpus = num_gpus
        self.params = params or SimGpuParams()
        self._resident: dict[tuple[str, int], tuple[int, int, int]] = {}  # (service, start) -> (start, size, mb)
        self._used = [0] * num_gpus
        self._busy: dict[int, str] = {}

    def restore_s(self, mb_per_device: int) -> float:
        return restore_seconds(mb_per_device, self.params.restore_gbps, self.params.restore_overhead_s)

    def exec_s(self, n_inputs: int, dop: int) -> float:
        return math.ceil(max(n_inputs, 0) / (self.params.batch_size * dop)) * self.params.batch_latency_s

    def run(self, decision: CacheDecision, n_inputs: int = 1, *, exec_s: float | None = None) -> SimTiming:
        """Apply the decision to the mirror and return the durations (no waiting)."""
        self._acquire(decision)
        try:
            for inst in decision.evict:
                self._drop((inst.service, inst.chunk.start))
            restore = 0.0
            if decision.service is not None and not decision.hit:
                self._add(decision)
                restore = self.restore_s(decision.restore_mb_per_device)
            elif decision.service is not None and (decision.service, decision.chunk.start) not in self._resident:
                raise AssertionError(f"hit on {decision.service}@{decision.chunk} that is not resident")
            run_s = self.exec_s(n_inputs, decision.dop) if exec_s is None else float(exec_s)
            return SimTiming(restore, run_s, decision.hit, tuple(i.service for i in decision.evict))
        finally:
            self._release(decision)

    async def execute(self, decision: CacheDecision, n_inputs: int = 1, *, exec_s: float | None = None,
                      sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> SimTiming:
        """:meth:`run`, then actually wait that long; a cancel during the restore undoes it."""
        timing = self.run(decision, n_inputs, exec_s=exec_s)
        self._acquire(decision)
        try:
            try:
                await sleep(timing.restore_s)
            except asyncio.CancelledError:
                if not decision.hit and decision.service is not None:
                    self._drop((decision.service, decision.chunk.start))  # half a restore is garbage
                raise
            await sleep(timing.exec_s)
            return timing
        finally:
            self._release(decision)

    def forget(self, service: str, start: int) -> None:
        """The books dropped an unconfirmed restore: drop it here too."""
        self._drop((service, start))

    def resident(self) -> list[tuple[str, int]]:
        return sorted(self._resident)

    def used_mb(self) -> list[int]:
        return list(self._used)

    # -- internals ---------------------------------------------------------- #

    def _add(self, d: CacheDecision) -> None:
        key = (d.service, d.chunk.start)
        self._drop(key)
        for dev in d.devices:
            self._used[dev] += d.restore_mb_per_device
        self._resident[key] = (d.chunk.start, d.chunk.size, d.restore_mb_per_device)
        over = [dev for dev in d.devices if self._used[dev] > self.params.memory_mb_per_gpu]
        if over:
            self._drop(key)
            raise MemoryError(f"simulated OOM restoring {d.service} on {d.chunk}: devices {over} over "
                              f"{self.params.memory_mb_per_gpu} MiB")

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._resident.pop(key, None)
        if entry is not None:
            start, size, mb = entry
            for dev in range(start, start + size):
                self._used[dev] -= mb

    def _acquire(self, d: CacheDecision) -> None:
        clash = {dev: self._busy[dev] for dev in d.devices if dev in self._busy}
        if clash:  # an invariant: a real exception, not an assert that `python -O` drops
            raise AssertionError(f"one action per GPU: {d.holder} on {d.chunk} clashes with {clash}")
        for dev in d.devices:
            self._busy[dev] = d.holder

    def _release(self, d: CacheDecision) -> None:
        for dev in d.devices:
            if self._busy.get(dev) == d.holder:
                del self._busy[dev]
