"""A runtime that survives the loss of a node (DESIGN.md §7).

:class:`ClusterRuntime` is :class:`~tangram.runtime.Runtime` plus
:meth:`node_down` / :meth:`node_up` (called by the health loop, or by hand):

* down: the node's pools leave the policy's view (:class:`~.gate.NodeGate`);
  its running actions end ``failed`` with ``node X is down: why`` (their
  executors are wrapped in :class:`NodeGuard`, which stops waiting for a dead
  node after ``grace_s``); its queued trajectory actions fail the same way;
  its trajectories' environments are *lost* (their files, processes and
  memory were on it): their memory reservations and node pins are released,
  and later actions in them are rejected at submit with
  :class:`EnvironmentLostError` (field ``environment``). The rest of the
  cluster keeps serving.
  Environments of an executor whose environments outlive an outage of the
  node (Docker: a container and its files survive a restart of the engine)
  are *suspended* instead: they keep their pin and memory reservation, and
  actions in them are refused with :class:`~tangram.core.errors.UnavailableError`
  (503, ``Retry-After``) until the node is back, or lost after ``give_up_s``.
* up: what was left of the lost environments on the node is removed, each
  suspended environment is reattached (its container started again if the
  engine stopped it, whatever its actions left running killed) or, if it did
  not survive, lost; only then do the pools come back to the policy (the
  books are balanced, nothing was leaked), and the policy runs again.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

from tangram.core.errors import UnavailableError, UnschedulableError
from tangram.core.model import Action
from tangram.executors.base import FAILED, EnvironmentExecutor, ExecResult, Placement
from tangram.runtime import Runtime
from tangram.scaleout.gate import DownNodes, NodeGate

log = logging.getLogger("tangram.scaleout")


class EnvironmentLostError(UnschedulableError):
    """The trajectory's environment lived on a node that went down: its state is gone."""


class NodeSignals:
    """Per node, an event set when it goes down (a fresh one each time it comes back)."""

    def __init__(self, down: DownNodes):
        self.down = down
        self._events: dict[str, asyncio.Event] = {}

    def event(self, node: str) -> asyncio.Event:
        ev = self._events.get(node)
        if ev is None:
            ev = self._events[node] = asyncio.Event()
            if node in self.down:
                ev.set()
        return ev

    def set_down(self, node: str) -> None:
        self.event(node).set()

    def set_up(self, node: str) -> None:
        self._events[node] = asyncio.Event()

    def message(self, node: str) -> str:
        why = self.down.reason(node)
        return f"node {node!r} is down" + (f": {why}" if why else "")


class NodeGuard:
    """Runs a call against one node, giving up with ``node X is down`` when the node dies."""

    def __init__(self, node: str, signals: NodeSignals, grace_s: float = 2.0):
        self.node = node
        self.signals = signals
        self.grace_s = grace_s
        # set by the health loop: probe the node now, mark it down if it does not answer; returns why
        self.suspect: Callable[[], Awaitable[str | None]] | None = None

    def down_result(self) -> ExecResult:
        return ExecResult(status=FAILED, error=self.signals.message(self.node), node_down=True)

    async def race(self, make: Callable[[], Awaitable[ExecResult]]) -> ExecResult:
        ev = self.signals.event(self.node)
        if ev.is_set():
            return self.down_result()
        task = asyncio.ensure_future(make())
        downw = asyncio.ensure_future(ev.wait())
        try:
            await asyncio.wait({task, downw}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            # the executor kills what it started before returning: wait for that, through further cancels
            # (each handed on: a GPU runner then keeps its chunk for a host still stopping), but only
            # grace_s more once the node is dead (a kill sent to a dead engine may hang)
            while not task.done() and not ev.is_set():
                try:
                    await asyncio.wait({task, downw}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:
                    task.cancel()
            if not task.done():
                try:
                    await asyncio.wait({task}, timeout=self.grace_s)
                except asyncio.CancelledError:
                    pass
            downw.cancel()
            if task.done():
                _swallow(task)
            else:
                task.add_done_callback(_swallow)
            raise
        if task.done():
            downw.cancel()
            exc = None if task.cancelled() else task.exception()
            if exc is None and not _broken(task.result()):
                return task.result()
            # the call broke (connection refused, actor died): a dead node, or a plain failure?
            if self.suspect is not None and await self.suspect() is not None:
                return self.down_result()
            return task.result()
        # the node died mid-action: let the executor try to clean up, but never hang on a dead node
        task.cancel()
        await asyncio.wait({task}, timeout=self.grace_s)
        if not task.done():
            task.add_done_callback(_swallow)
        else:
            _swallow(task)
        return self.down_result()


def _broken(r: ExecResult) -> bool:
    """Failed without a process exit code: the executor could not run or finish it (vs. a failing command)."""
    return r.node_down or (r.status == FAILED and r.exit_code is None)


def _swallow(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" noise for an abandoned call


class GuardedEnvExecutor(EnvironmentExecutor):
    """An environment executor of one node that fails fast while the node is down."""

    def __init__(self, inner: EnvironmentExecutor, guard: NodeGuard):
        self.inner = inner
        self.guard = guard
        self.name = f"{getattr(inner, 'name', 'env')}@{guard.node}"
        self.orphans: set[str] = set()  # environments to remove from the node once it is back

    @property
    def stop_grace_s(self) -> float | None:
        return getattr(self.inner, "stop_grace_s", None)

    @property
    def allow_network(self) -> bool:  # read by the runtime's placement of networked environments
        return bool(getattr(self.inner, "allow_network", False))

    async def create_environment(self, env_id: str, **kw: Any) -> None:
        if self.guard.signals.event(self.guard.node).is_set():
            raise RuntimeError(self.guard.signals.message(self.guard.node))
        await self.inner.create_environment(env_id, **kw)

    async def destroy_environment(self, env_id: str) -> None:
        if self.guard.signals.event(self.guard.node).is_set():
            self.orphans.add(env_id)  # the node cannot be asked now; clean it when it returns
            return
        await self.inner.destroy_environment(env_id)

    async def exec(self, env_id: str, command: str, placement: Placement, *, timeout_s: float | None = None,
                   env: Mapping[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        extra = {} if stdin is None else {"stdin": stdin}
        return await self.guard.race(lambda: self.inner.exec(env_id, command, placement, timeout_s=timeout_s, env=env,
                                                             **extra))

    async def cleanup_orphans(self) -> None:
        for env_id in list(self.orphans):
            self.orphans.discard(env_id)
            try:
                await self.inner.destroy_environment(env_id)
            except Exception as exc:  # noqa: BLE001 - best effort: the node may have lost it already
                self.orphans.add(env_id)  # tried again when the node next comes back
                log.warning("node %s: removing lost environment %s failed: %s", self.guard.node, env_id, exc)

    async def close(self) -> None:
        if self.guard.signals.event(self.guard.node).is_set():
            return  # a dead endpoint would only make shutdown hang
        await self.inner.close()

    # crash recovery: straight to the node's executor
    def set_owner(self, owner: str) -> None:
        self.inner.set_owner(owner)

    async def adopt_environment(self, env_id: str, *, memory_mb: int = 0, network: bool = False) -> bool:
        return await self.inner.adopt_environment(env_id, memory_mb=memory_mb, network=network)

    async def sweep_unrecorded(self, keep: set[str]) -> list[str]:
        return await self.inner.sweep_unrecorded(keep)

    def detach(self) -> None:
        self.inner.detach()

    @property
    def outlives_outages(self) -> bool:
        return self.inner.outlives_outages

    async def reattach_environment(self, env_id: str) -> bool:
        return await self.inner.reattach_environment(env_id)


class GuardedModelRunner:
    """A GPU node's model executor that fails fast while the node is down."""

    def __init__(self, inner: Any, guard: NodeGuard):
        self.inner = inner
        self.guard = guard

    async def run(self, action: Action, placement: Placement, *, timeout_s: float | None = None) -> ExecResult:
        return await self.guard.race(lambda: self.inner.run(action, placement, timeout_s=timeout_s))

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            r = close()
            if asyncio.iscoroutine(r):
                await r

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ClusterRuntime(Runtime):
    """A :class:`Runtime` over several nodes, any of which may go down and come back.

    The engine's managers must be :class:`NodeGate` wrappers sharing ``down``
    (see :func:`tangram.scaleout.gate.gate_all`).
    """

    def __init__(self, engine: Any, *, down: DownNodes, grace_s: float = 2.0, give_up_s: float = 300.0, **kw: Any):
        for m in engine.managers:
            if not isinstance(m, NodeGate) or m.down is not down:
                raise ValueError("ClusterRuntime: every manager of the engine must be a NodeGate sharing `down`")
        self.down = down
        self.signals = NodeSignals(down)
        env_executors = {node: ex if isinstance(ex, GuardedEnvExecutor)
                         else GuardedEnvExecutor(ex, NodeGuard(node, self.signals, grace_s))
                         for node, ex in dict(kw.pop("env_executors", None) or {}).items()}
        mex = kw.pop("model_executors", None)
        if isinstance(mex, Mapping):
            mex = {node: GuardedModelRunner(ex, NodeGuard(node, self.signals, grace_s)) for node, ex in mex.items()}
        super().__init__(engine, env_executors=env_executors, model_executors=mex, **kw)
        self.lost: dict[str, tuple[str, str]] = {}  # environment -> (node, why)
        self.suspended: dict[str, tuple[str, str, float]] = {}  # environment -> (node, why, since): may come back
        self.give_up_s = float(give_up_s)
        self.monitor: Any = None
        self._bg: set[asyncio.Task] = set()
        self._downs: dict[str, int] = {}  # node -> times marked down: tells a stale reattach from a current one

    # ------------------------------------------------------------------ #

    def submit(self, action: Action, *, received_at: float | None = None, held_s: float = 0.0) -> str:
        # an exec action runs in its environment; an http or model action only names its trajectory
        t = action.trajectory if action.payload.get("kind", "exec") == "exec" else None
        if t is not None and t in self.suspended:
            node, why, since = self.suspended[t]
            if time.monotonic() - since <= self.give_up_s:
                raise UnavailableError(
                    "environment", f"environment {t!r} lives on node {node!r}, which is down ({why}); retry when "
                    f"it is back (after {self.give_up_s:g} s down it is given up as lost)", retry_after_s=1)
            self._lose(t, node, f"{why}; not back within {self.give_up_s:g} s")
        if t is not None and t in self.lost:
            node, why = self.lost[t]
            raise EnvironmentLostError(
                "environment",
                f"environment {t!r} lived on node {node!r}, which went down ({why}); its files and "
                f"processes are gone: delete it and create a new environment")
        try:
            return super().submit(action, received_at=received_at, held_s=held_s)
        except UnschedulableError as exc:
            if not len(self.down) or isinstance(exc, EnvironmentLostError):
                raise
            # "can never fit" may only mean "not while these nodes are down": say so
            raise UnschedulableError(exc.field, f"{exc.reason} (nodes down now: {sorted(self.down)})") from None

    async def delete_environment(self, env_id: str) -> None:
        await super().delete_environment(env_id)
        self.lost.pop(env_id, None)
        self.suspended.pop(env_id, None)

    def _lose(self, t: str, node: str, why: str) -> None:
        ex = self.env_executors.get(node)
        if self.suspended.pop(t, None) is not None and node in self.down and isinstance(ex, GuardedEnvExecutor):
            ex.orphans.add(t)  # given up while its node is down: its container goes once the node is back
        self.lost[t] = (node, why)
        self.close_trajectory(t)  # its memory reservation and pin go

    def node_down(self, node: str, reason: str = "stopped answering") -> bool:
        """Take ``node`` out of service; False if it was already down."""
        if not self.down.mark_down(node, reason):
            return False
        self._downs[node] = self._downs.get(node, 0) + 1
        self.signals.set_down(node)  # running actions on it end `failed` through their guards
        if self.monitor is not None:
            self.monitor.mark_down(node)  # marked by hand or by a broken call: the loop reports its return
        msg = self.signals.message(node)
        eng = self.engine
        for aid, rec in list(eng.waiting.items()):
            t = rec.action.trajectory
            if t is not None and eng.placement.get(t) == node:
                self.fail_queued(aid, msg, node_down=True)
        keeps = getattr(self.env_executors.get(node), "outlives_outages", False)
        for t, n in list(eng.placement.items()):
            if n != node:
                continue
            if keeps and t in self.env_registry:  # its container may well be there when the node is back
                self.suspended[t] = (node, reason, time.monotonic())
            else:
                self._lose(t, node, reason)
        log.warning("%s; %d environment(s) lost, %d suspended until it is back", msg,
                    sum(1 for n, _ in self.lost.values() if n == node),
                    sum(1 for n, _, _ in self.suspended.values() if n == node))
        return True

    def node_up(self, node: str) -> bool:
        """Put ``node`` back in service; False if it was not down."""
        if not self.down.mark_up(node):
            return False
        self.signals.set_up(node)
        if self.monitor is not None:
            self.monitor.down.discard(node)
            self.monitor.misses[node] = 0
        self.down.release(node)  # held by an earlier return that another outage cut short
        ex = self.env_executors.get(node)
        if isinstance(ex, GuardedEnvExecutor) and (ex.orphans or any(n == node for n, _, _ in self.suspended.values())):
            # nothing is placed there until the leftovers are removed or killed, or new work would share its cores
            self.down.hold(node)
            task = asyncio.get_running_loop().create_task(self._back(node, ex, self._downs.get(node, 0)))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
        log.warning("node %r is back", node)
        self.tick()
        return True

    async def _back(self, node: str, ex: GuardedEnvExecutor, gen: int) -> None:
        """Remove what was left of the node's lost environments; reattach its suspended ones.

        The node stays held (nothing placed there) until the orphans are removed and each suspended
        environment had one reattach (which kills what its actions left running).
        A reattach that fails while the node stays up (an engine that answers its health
        check while it still restores a container) is tried again, backing off, until it
        works or the environment's ``give_up_s`` runs out; if the node goes down again
        (``gen`` is stale) the next ``node_up`` takes over."""
        try:
            await ex.cleanup_orphans()
            pending = [t for t, (n, _, _) in self.suspended.items() if n == node]
            delay = 0.25
            while pending and self._downs.get(node, 0) == gen:
                retry = []
                for t in pending:
                    entry = self.suspended.get(t)
                    if entry is None or entry[0] != node:  # deleted, or suspended anew, meanwhile
                        continue
                    why, since = entry[1], entry[2]
                    try:
                        ok = await ex.reattach_environment(t)
                    except Exception as exc:  # noqa: BLE001 - not ready yet, or the node failed again
                        log.warning("node %s: reattaching environment %s failed: %s", node, t, exc)
                        if time.monotonic() - since <= self.give_up_s:
                            retry.append(t)
                        continue
                    # deleted, or the node went down again meanwhile: that newer suspension is not ours to end
                    if self._downs.get(node, 0) != gen or self.suspended.get(t) is not entry:
                        continue
                    if ok:
                        del self.suspended[t]
                    else:
                        self._lose(t, node, f"{why}; its environment did not survive")
                self._show(node, gen)
                pending = retry
                if pending:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 5.0)
        finally:
            self._show(node, gen)
        log.info("node %r: suspended environments handled", node)

    def _show(self, node: str, gen: int) -> None:
        """The node's cleanup is done: its pools go back to the policy (unless it went down since)."""
        if self._downs.get(node, 0) == gen and self.down.release(node):
            self.tick()

    # ------------------------------------------------------------------ #

    def start_health(self, probes: Mapping[str, Callable[[], Awaitable[None]]], *, interval_s: float = 1.0,
                     timeout_s: float = 2.0, failures: int = 2) -> Any:
        from tangram.scaleout.health import HealthMonitor

        self.monitor = mon = HealthMonitor(probes, on_down=self.node_down, on_up=self.node_up,
                                           interval_s=interval_s, timeout_s=timeout_s, failures=failures)
        for node in probes:
            guard = getattr(self.env_executors.get(node), "guard", None)
            mex = self.model_executors
            guard = guard or getattr(mex.get(node) if isinstance(mex, Mapping) else None, "guard", None)
            if guard is not None:
                guard.suspect = functools.partial(self._suspect, node)
        mon.start()
        return mon

    async def _suspect(self, node: str) -> str | None:
        """An action on ``node`` broke: one probe now decides (a broken call and a failed ping is enough)."""
        if node in self.down:
            return self.down.reason(node)
        why = await self.monitor.probe(node)
        if why is not None:
            self.node_down(node, why)
        return why

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["nodes_down"] = {n: self.down.reason(n) for n in self.down}
        out["environments_lost"] = len(self.lost)
        out["environments_suspended"] = len(self.suspended)
        return out

    async def close(self) -> None:
        if self.monitor is not None:
            await self.monitor.close()
        for t in list(self._bg):
            t.cancel()
        await super().close()
