"""The model runner of one GPU node, the same for a local torch executor and a remote (Ray) host.

The manager keeps the books (which service is resident on which chunk);
the host holds the state (device memory). For each action the runner asks
the manager for its cache decision (evict these, restore that), has the
host carry it out, and only after a successful run confirms the restore in
the books, so a failed or cancelled restore is never counted as resident.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping, Protocol

from tangram.core.grants import CacheDecision, parse_service
from tangram.core.model import Action
from tangram.executors.base import SUCCEEDED, TIMEOUT, ExecResult, Placement

# what a model action's payload hands to the host (``exec_s``: a simulated host's run time)
PAYLOAD_FIELDS = ("model", "op", "inputs", "tokens", "exec_s")
log = logging.getLogger("tangram.runtime.gpu")
# [reason] a load copies a model from host memory to its chunk: 140 GB at 2 GB/s takes 70 s; a host that
# has not answered in ten minutes hangs, and a host that can stop (a Ray host) gives the load up then (the
# in-process torch host finishes a restore it has begun: it stops only between batches, and a load has none)
WARM_LOAD_TIMEOUT_S = 600.0


class ModelHost(Protocol):
    """Carries out a cache decision and runs the batch (TorchGpuExecutor, a Ray host's proxy).

    A host whose calls can outlive their cancel (a remote one) also has ``stopping(holder)``: the future
    of the call of ``holder`` that was cancelled or timed out and has not stopped yet, or None."""

    async def execute(self, decision: CacheDecision, payload: Mapping[str, Any], *,
                      timeout_s: float | None = None) -> ExecResult: ...


class GpuRunner:
    """``run(action, placement)`` for one GPU node: lease from the books, execute on the host, confirm."""

    def __init__(self, manager: Any, host: ModelHost, pool: str):
        self.manager = manager
        self.host = host
        self.pool = pool
        self.warm_loads = 0  # instances the warm start loaded (start_warm)
        self._warm: asyncio.Task | None = None
        # the runtime's round (wire_rounds): a chunk kept for a host that had not stopped is free again
        self.on_free: Callable[[], None] | None = None

    async def run(self, action: Action, placement: Placement, *, timeout_s: float | None = None) -> ExecResult:
        decision = self.manager.lease(self.pool, action.id)
        if decision is None:
            raise RuntimeError(f"{action.id} holds no lease on {self.pool}")
        p = action.payload
        payload = {k: p[k] for k in PAYLOAD_FIELDS if k in p}
        try:
            res = await self.host.execute(decision, payload, timeout_s=timeout_s)
        except asyncio.CancelledError:
            self._keep_until_stopped(action.id, decision.chunk)
            raise
        if res.status == TIMEOUT:
            self._keep_until_stopped(action.id, decision.chunk)
        if res.status == SUCCEEDED and res.restored:
            # only now is the service resident in the books (a cancelled restore is forgotten by `end`)
            self.manager.restored(self.pool, action.id, res.restore_s)
        return res

    def _still_running(self, holder: str) -> asyncio.Future | None:
        stopping = getattr(self.host, "stopping", None)
        fut = stopping(holder) if stopping is not None else None
        return fut if fut is not None and not fut.done() else None

    def _keep_until_stopped(self, holder: str, chunk: Any = None, on_free: Callable[[], None] | None = None) -> bool:
        """``holder``'s call (an action's, a warm load's) was cancelled or timed out and its host has not
        stopped it: its chunk stays taken (``GpuManager.detain``: counted as stopping) until the host has,
        then goes back and ``on_free`` (else the runtime's round) runs. False: the host has stopped it."""
        fut = self._still_running(holder)
        if fut is None:
            return False
        key = self.manager.detain(self.pool, holder, chunk)
        if key is None:  # the engine released it first (the node went down), or it is another run's now
            return True
        log.warning("%s: the host has not stopped %s after its cancel: its GPUs stay held until it does",
                    self.pool, holder)
        fut.add_done_callback(lambda _: self._stopped(key, on_free or self.on_free))
        return True

    def start_warm(self, on_free: Callable[[], None], down: Callable[[], asyncio.Event] | None = None) -> None:
        """Load this node's warm plan in the background (:mod:`tangram.managers.gpu_warm`): every load whose
        chunk is free starts (disjoint chunks side by side), each holding its chunk as an action does; after
        each ends, ``on_free`` (the runtime's round) runs before the next loads start, so a waiting request
        goes first. Ends when the plan is loaded, when what is left is held by requests, or when the node
        goes down: ``down`` gives the event its scale-out guard sets then (none begins on a node down at
        start; the loads under way are stopped, and their chunks go back once the host has stopped)."""
        if self._warm is None:
            self._warm = asyncio.get_running_loop().create_task(self._warm_up(on_free, down), name=f"warm-{self.pool}")
            self._warm.add_done_callback(self._warm_ended)

    def _warm_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the warm start stopped: %r", self.pool, task.exception())

    async def _warm_up(self, on_free: Callable[[], None], down: Callable[[], asyncio.Event] | None) -> None:
        node_down = down() if down is not None else None
        running: dict[asyncio.Future, str] = {}
        downw: asyncio.Future | None = None
        try:
            pending = [] if _is_set(node_down) else list(self.manager.warm_plan(self.pool))
            if node_down is not None:
                downw = asyncio.ensure_future(node_down.wait())  # only wakes the wait: is_set() decides
            while pending or running:
                if _is_set(node_down):
                    log.warning("%s: the node is down: its warm start ends (%d loads under way stopped, %d not "
                                "begun)", self.pool, len(running), len(pending))
                    return  # below: each load stopped, its chunk back once the host has stopped
                started, pending = self.manager.warm_next(self.pool, pending)
                for holder, decision in started:
                    running[asyncio.ensure_future(self._load(decision, holder))] = holder
                if not running:  # requests (or hosts still stopping a load) hold what is left
                    if pending:
                        log.info("%s: its warm start ends with %d loads not begun: their chunks are taken",
                                 self.pool, len(pending))
                    break
                await asyncio.wait({*running, *([downw] if downw is not None else [])},
                                   return_when=asyncio.FIRST_COMPLETED)
                for task in [t for t in running if t.done()]:  # every load that ended, whatever woke the wait
                    self._stopped(running.pop(task), None)
                    if task.cancelled():
                        continue
                    if task.exception() is not None:
                        log.warning("%s: a warm start load failed: %r", self.pool, task.exception())
                        continue
                    res = task.result()
                    if res.status == SUCCEEDED and res.restored:
                        self.warm_loads += 1
                    elif res.node_down and pending:  # the host's own call found it dead, before the guard did
                        log.warning("%s: a load found the node down: its warm start ends, %d loads not begun",
                                    self.pool, len(pending))
                        pending = []
                on_free()
        finally:
            if downw is not None:
                downw.cancel()
            gone = _is_set(node_down)
            for task, holder in running.items():
                task.cancel()
                task.add_done_callback(lambda _, h=holder: self._stopped(h, on_free if gone else None))
            await asyncio.gather(*running, return_exceptions=True)

    def _stopped(self, holder: str, on_free: Callable[[], None] | None) -> None:
        """A stopped load's chunk goes back once the host has stopped it, even if the wait for it is cancelled
        again (a close that timed out), or its call gave up waiting for the host (``stopping``): not while
        the host may still copy onto it. On a node that went down (not at close) the runtime's round runs:
        the node may be back."""
        if self._keep_until_stopped(holder, on_free=on_free):
            return
        self.manager.release(self.pool, holder)
        if on_free is not None:
            on_free()

    async def _load(self, decision: CacheDecision, holder: str) -> ExecResult:
        """Restore ``decision``'s instance through the host (a model action with no inputs)."""
        res = await self.host.execute(decision, {"model": parse_service(decision.service)[0], "op": "embed",
                                                 "inputs": []}, timeout_s=WARM_LOAD_TIMEOUT_S)
        if res.status == SUCCEEDED and res.restored:
            self.manager.restored(self.pool, holder, res.restore_s)
        else:
            log.warning("%s: warm start could not load %s on %s: %s", self.pool, decision.service, decision.chunk,
                        res.error or res.status)
        return res

    async def close(self) -> None:
        if self._warm is not None:
            self._warm.cancel()
            await asyncio.gather(self._warm, return_exceptions=True)
        close = getattr(self.host, "close", None)
        if close is not None:
            r = close()
            if hasattr(r, "__await__"):
                await r


def _is_set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


def wire_rounds(model_executors: Mapping[str, Any] | Any, on_free: Callable[[], None]) -> None:
    """Give each :class:`GpuRunner` among a runtime's model executors (a scale-out node's behind its guard)
    the runtime's round, run when a chunk it kept for a host still stopping a call is free again."""
    for ex in (model_executors.values() if isinstance(model_executors, Mapping) else [model_executors]):
        runner = getattr(ex, "inner", ex)
        if isinstance(runner, GpuRunner) and runner.on_free is None:
            runner.on_free = on_free
