"""A warm start in the simulator: each GPU node loads its warm plan from t = 0, chunk by chunk.

The plan is the live manager's (:meth:`tangram.managers.gpu.GpuManager.warm_plan`); each load holds
its chunk through :meth:`GpuManager.warm` for the restore time the workload's bandwidth gives, as a
request's restore would, so a request that comes meanwhile finds those GPUs busy. Loads of disjoint
chunks run side by side; a load waits for its chunk, and one whose chunk a request holds is tried
again when another load of its node ends, and dropped once none is left to end (the node is busy:
the rest of its plan is not loaded). A load's GPU-seconds count as busy and reserved, as a request's
restore does. The simulation's ``TICK`` event ends a load
(:meth:`WarmStart.loaded`) and runs the engine's round before the next loads start: a waiting
request goes first.
"""
from __future__ import annotations

from typing import Any

from tangram.core.grants import restore_seconds


class WarmStart:
    def __init__(self, sim: Any, tick: int):
        self._sim, self._tick = sim, tick
        self._gpu = sim.gpu
        self._pending = {pool: self._gpu.warm_plan(pool) for pool in self._gpu.nodes}
        # holder -> (when it is loaded, pool, seconds, GPUs)
        self._running: dict[str, tuple[float, str, float, int]] = {}
        self.loads = 0
        self.gpu_s = 0.0  # GPU-seconds the loads that ended took
        for pool in self._pending:
            self._start(pool)

    def _start(self, pool: str) -> None:
        started, left = self._gpu.warm_next(pool, self._pending[pool])
        for holder, decision in started:
            seconds = restore_seconds(decision.restore_mb_per_device, self._sim.wl.cluster.restore_gbps)
            done = self._sim.now + seconds
            self._running[holder] = (done, pool, seconds, decision.chunk.size)
            self._sim._ticks.add(done)
            self._sim._push(done, self._tick, None)
        self._pending[pool] = left if any(r[1] == pool for r in self._running.values()) else []

    def loaded(self, now: float):
        """End every load due by ``now`` (its instance resident), run the engine's round (the requests
        waiting go first), then start the loads the chunks still free allow; returns the round's starts."""
        ended = [(h, pool, seconds, gpus) for h, (done, pool, seconds, gpus) in self._running.items() if done <= now]
        sim = self._sim
        for holder, pool, seconds, gpus in ended:
            del self._running[holder]
            self.gpu_s += gpus * seconds
            if "gpu" in sim.busy:
                sim.busy["gpu"] += gpus * seconds
                sim.reserved["gpu"] += gpus * seconds
            self._gpu.restored(pool, holder, seconds)
            self._gpu.release(pool, holder)
            self.loads += 1
        started = sim.engine.tick()
        for pool in sorted({pool for _, pool, _, _ in ended}):
            self._start(pool)
        return started
