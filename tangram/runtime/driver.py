"""The async driver of one :class:`~tangram.core.engine.Engine` (DESIGN.md §2, §6).

The engine is synchronous and never touches the world; the driver is the
other half: it owns the engine (real clock), the job table and the wake-up
timer, and turns every :class:`~tangram.core.engine.Started` into an
asyncio task that

1. builds a :class:`~tangram.executors.base.Placement` from the grants
   (:mod:`.dispatch`),
2. makes sure the action's environment exists on its node (:mod:`.environments`),
3. runs the action on the executor of its kind under ``timeout_s``,
4. reports back with :meth:`Engine.complete` *after* the executor returned
   (so the process is dead before its cores are reused) and dispatches what
   starts next.

Quota refills wake the engine at :meth:`Engine.next_wakeup` with :meth:`Engine.tick` (at once for
units back since the last round). Cancellation (``Runtime.cancel`` or the awaiting task being
cancelled) kills a running action through its executor; an executor crash becomes ``failed``; in
every case each grant is released exactly once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from collections import deque
from typing import Any, Awaitable, Callable, Iterable, Mapping

from tangram.core.engine import WAITING, Engine, Started
from tangram.core.errors import UnavailableError, UnknownActionError, UnschedulableError, invariant
from tangram.core.model import Action, Profile
from tangram.executors.base import (CANCELLED, FAILED, TIMEOUT, EnvironmentExecutor, ExecResult, Placement,
                                    wait_through_cancels)
from tangram.runtime.actions import ActionOutcome, Timing, build_action
from tangram.runtime.loose import LooseTrajectories
from tangram.runtime.upstream import requeue_after_429
from tangram.runtime.dispatch import Dispatcher, ExecutorTimedOut, allocation_of, placement_of
from tangram.runtime.environments import Environment, Environments, network_node, quietly
from tangram.runtime.gpu import wire_rounds
from tangram.runtime.job import Job
from tangram.runtime.stats import RuntimeStats

log = logging.getLogger("tangram.runtime")


class Runtime:
    """One engine, its managers and executors, driven on the running event loop.

    ``env_executors`` maps each CPU node to the executor of its environments;
    ``model_executors`` maps each GPU node to an object with
    ``async run(action, placement, *, timeout_s) -> ExecResult`` (or a
    single such object for every node); ``http_executor`` has
    ``async run(request, *, timeout_s) -> ExecResult``. To build one from a
    cluster config, use :func:`tangram.service.build.build_runtime`.
    """

    def __init__(
        self, engine: Engine, *,
        env_executors: Mapping[str, EnvironmentExecutor] | None = None,
        http_executor: Any = None,
        model_executors: Mapping[str, Any] | Any = None,
        models: Iterable[str] | None = None,
        profiles: Mapping[str, Profile] | None = None,
        keep_results: int = 100_000,
        closers: Iterable[Callable[[], Awaitable[None]]] = (),
    ):
        self.engine = engine
        self.clock = engine.clock
        self.dispatcher = Dispatcher(dict(env_executors or {}), http_executor, model_executors)
        wire_rounds(model_executors, self.tick)  # a GPU chunk kept for a host still stopping comes back
        self.env_registry = Environments(self.dispatcher.env_executors)
        self.loose = LooseTrajectories(engine.generating)  # the trajectories http and model actions name
        # the models the GPU nodes can serve (None: unchecked); an unknown one never reaches a manager
        self.models: frozenset[str] | None = None if models is None else frozenset(models)
        self.profiles: dict[str, Profile] = dict(profiles or {})
        self.statistics = RuntimeStats()
        self.counts = self.statistics.counts  # (kind, status) -> n
        self.upstream_429s_absorbed: dict[str, int] = {}  # API pool -> 429s re-queued instead of returned
        self.listeners: list[Callable[[Job, ActionOutcome], None]] = []
        self._keep_results = keep_results
        self._closers = list(closers)
        self._jobs: dict[str, Job] = {}
        self._finished: deque[str] = deque()  # finished job ids, oldest first (bounded retention)
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at: float | None = None
        self._closed = False
        # close() leaves environments in place for the next start (the service with durable state)
        self.keep_environments = False

    @property
    def env_executors(self) -> dict[str, EnvironmentExecutor]:
        return self.dispatcher.env_executors

    @property
    def http_executor(self) -> Any:
        return self.dispatcher.http_executor

    @property
    def model_executors(self) -> Mapping[str, Any] | Any:
        return self.dispatcher.model_executors

    # ------------------------------------------------------------------ #
    # building actions

    def build_action(
        self,
        kind: str,
        resources: Mapping[str, Any] | None = None,
        *,
        environment: str | None = None, command: str | None = None, profile: str | None = None,
        timeout_s: float | None = None, action_class: str | None = None,
        payload: Mapping[str, Any] | None = None, action_id: str | None = None,
        restartable: bool = False, trajectory: str | None = None,
    ) -> Action:
        """Validate and build an action; raises DemandError (naming the field) or UnknownEnvironmentError."""
        return build_action(
            kind, resources, pools=self.engine.pool_states(), models=self.models, profiles=self.profiles,
            executors=self.dispatcher.kinds() | {"exec"},
            environment=environment, environment_memory=lambda e: self.env_registry.get(e).memory_mb,
            command=command, profile=profile, timeout_s=timeout_s, action_class=action_class,
            payload=payload, action_id=action_id, restartable=restartable, trajectory=self.loose.name(trajectory),
            restore_estimate=next((m.restore_estimate for m in self.engine.managers
                                   if hasattr(m, "restore_estimate")), None))

    # ------------------------------------------------------------------ #
    # running actions

    def submit(self, action: Action, *, received_at: float | None = None, held_s: float = 0.0) -> str:
        """Queue ``action``; its id (UnschedulableError if it can never fit). ``held_s``: already held at the gate."""
        if self._closed:
            raise RuntimeError("the runtime is closed")
        received_at = self.clock() if received_at is None else received_at
        kind = action.payload.get("kind", "exec")
        env = self.env_registry.get(action.trajectory) if action.trajectory is not None and kind == "exec" else None
        if action.id in self._jobs:
            raise UnschedulableError("id", f"action {action.id!r} was already submitted")
        job = Job(action, kind, received_at, env, held_s)
        self._jobs[action.id] = job
        try:
            started = self.engine.submit(action)
        except BaseException:
            del self._jobs[action.id]
            raise
        job.enqueued_at = self.clock()
        if env is not None:
            env.active.add(action.id)
        elif action.trajectory is not None and action.trajectory not in self.env_registry:  # else: closes with it
            self.loose.seen(action.trajectory)
        self._launch(started)
        return action.id

    async def run(self, action: Action, *, received_at: float | None = None) -> ActionOutcome:
        """Submit and wait for the result; if the caller is cancelled, so is the action."""
        action_id = self.submit(action, received_at=received_at)
        return await self.wait(action_id)

    async def wait(self, action_id: str) -> ActionOutcome:
        """Wait for a submitted action; cancelling the waiter cancels the action."""
        job = self._job(action_id)
        try:
            return await asyncio.shield(job.done)
        except asyncio.CancelledError:
            if job.outcome is None:
                self.cancel(action_id)
            raise

    async def wait_finished(self, action_id: str, timeout_s: float) -> ActionOutcome | None:
        """Wait up to ``timeout_s`` for an action's outcome without cancelling it if the waiter goes."""
        job = self._job(action_id)
        try:
            return await asyncio.wait_for(asyncio.shield(job.done), timeout_s)
        except asyncio.TimeoutError:
            return None

    def result(self, action_id: str) -> ActionOutcome | None:
        """The outcome if finished, None while waiting or running."""
        return self._job(action_id).outcome

    def state(self, action_id: str) -> str:
        job = self._job(action_id)
        if job.outcome is not None:
            return job.outcome.status
        try:
            return self.engine.record(action_id).state
        except UnknownActionError:
            return WAITING

    def cancel(self, action_id: str) -> bool:
        """Cancel a waiting or running action; False if it had already finished."""
        job = self._job(action_id)
        if job.outcome is not None:
            return False
        if action_id in self.engine.waiting:
            started = self.engine.cancel(action_id)
            self._finish(job, ExecResult(status=CANCELLED, error="cancelled while queued"), None, 0.0)
            self._launch(started)
        elif job.task is not None:
            job.cancelling = True
            self.engine.books.withdraw(action_id)  # a restart now would start a run bound to be cancelled
            job.task.cancel()  # the task kills the process, then completes the engine
        return True

    def fail_queued(self, action_id: str, reason: str, *, node_down: bool = False) -> bool:
        """End a queued action as ``failed`` because of ``reason``; False if it was not queued."""
        if action_id not in self.engine.waiting:
            return False
        started = self.engine.fail(action_id, reason)
        job = self._jobs.get(action_id)
        if job is not None and job.outcome is None:
            self._finish(job, ExecResult(status=FAILED, error=reason, node_down=node_down), None, 0.0)
        self._launch(started)
        return True

    def close_trajectory(self, trajectory: str) -> None:
        """Release a trajectory's node pin and memory reservation now (its environment stays registered)."""
        self._launch(self.engine.close_trajectory(trajectory))

    def tick(self) -> None:
        """Run the policy again (capacity came back outside of any action's completion)."""
        if not self._closed:
            self._launch(self.engine.tick())

    def _job(self, action_id: str) -> Job:
        job = self._jobs.get(action_id)
        if job is None:
            raise UnknownActionError(f"action {action_id!r} is unknown")
        return job

    def _launch(self, started: list[Started]) -> None:
        loop = asyncio.get_running_loop()
        for s in started:
            job = self._jobs.get(s.record.id)
            if job is None:  # submitted to the engine behind our back: refuse to run it
                self._launch(self.engine.complete(s.record.id, FAILED))
                continue
            if s.restart and job.task is not None:  # stopped now; the wider run begins once it is gone
                job.stopping = [t for t in job.stopping if not t.done()] + [job.task]
                job.task.cancel()
            job.task = loop.create_task(self._execute(job, s))
            job.task.add_done_callback(functools.partial(self._task_done, job))
        self._arm_wakeup()

    def _task_done(self, job: Job, task: asyncio.Task) -> None:
        # A task cancelled before its first step never ran its body: complete it here,
        # so no grant outlives it. (A task whose call was re-queued is no longer the job's.)
        if job.outcome is None and job.task is task:
            if old := [t for t in job.stopping if not t.done()]:  # a restarted run: complete once the old is gone
                return old[0].add_done_callback(lambda _: self._task_done(job, task))
            self._complete(job, ExecResult(status=CANCELLED, error="cancelled before it started"), None, 0.0)
            if job.env is not None and job.env.oneshot:
                self.env_registry.background(self.env_registry.drop(job.env))

    async def _execute(self, job: Job, s: Started) -> None:
        a = run = job.action
        placement: Placement | None = None
        exec_s = 0.0
        try:
            placement = placement_of(s)  # before a restart's checks: a result that ends there says where it was
            if job.stopping:  # runs a restart stopped: their executors kill their processes first
                cancelled = False
                for t in list(job.stopping):  # whatever cancels this meanwhile: its units are theirs till then
                    cancelled |= await wait_through_cancels(t)
                if cancelled or job.cancelling or self._closed:  # what cancelled the old run holds for this one
                    raise asyncio.CancelledError
                if a.timeout_s is not None:  # the stopped runs' time counts: a restart never moves the deadline
                    run = dataclasses.replace(a, timeout_s=a.timeout_s - s.record.restarted_s)
                    if run.timeout_s <= 0:
                        raise ExecutorTimedOut()
            await self._prepare(job, placement)  # environment set-up is overhead, not the action's run
            t0 = self.clock()
            try:
                result = await self.dispatcher.run(run, job.kind, job.env.id if job.env else None, placement)
            finally:
                exec_s = self.clock() - t0
            # an executor that measures its own run (without its setup) is more precise
            if result.exec_s is not None and 0 <= result.exec_s <= exec_s:
                exec_s = result.exec_s
        except asyncio.CancelledError:
            result = ExecResult(status=CANCELLED, error="cancelled")
        except ExecutorTimedOut:
            result = ExecResult(status=TIMEOUT, error=f"no result within {a.timeout_s:g} s")
        except Exception as exc:  # an executor crash is a failed action, never a leak
            log.warning("action %s: executor failed: %r", a.id, exc)
            result = ExecResult(status=FAILED, error=f"{type(exc).__name__}: {exc}")
        if job.task is not asyncio.current_task():
            return  # a restart stopped this run: the run that superseded it completes the action
        if job.kind == "http" and (again := requeue_after_429(self.engine, job, s.grants, result, self.clock(),
                                                               self.upstream_429s_absorbed)) is not None:
            job.task = None
            return self._launch(again)
        if job.env is not None and job.env.oneshot:
            try:
                await asyncio.shield(self.env_registry.drop(job.env))
            except asyncio.CancelledError:
                pass  # cancelled again while cleaning up: the grants are released below anyway
            except Exception:  # noqa: BLE001 - cleanup must not keep the grants
                log.exception("action %s: removing its one-shot environment failed", a.id)
        self._complete(job, result, placement, exec_s)

    async def _prepare(self, job: Job, placement: Placement) -> None:
        """Make sure an exec action's environment exists on its node (a one-shot one is made now)."""
        if job.kind != "exec":
            return
        if placement.node is None or placement.node not in self.env_executors:
            raise RuntimeError(f"node {placement.node!r} has no environment executor")
        if job.env is None:  # a one-shot environment, removed after the action
            job.env = self.env_registry.oneshot(f"oneshot-{job.action.id}", job.action.mem_mb)
        await self.env_registry.ensure_created(job.env, placement.node)

    def _complete(self, job: Job, result: ExecResult, placement: Placement | None, exec_s: float) -> None:
        restore = result.restore_s  # the engine rejects NaN, inf or < 0 (and keeps the action running)
        restore = restore if (restore > 0 and math.isfinite(restore)) else 0.0
        try:
            started = self.engine.complete(job.action.id, result.status, restore_s=restore)
        except UnknownActionError:  # already cancelled in the engine (close, delete_environment)
            started = []
        except Exception:  # noqa: BLE001 - the grants were released before the policy ran; keep driving
            log.exception("action %s: scheduling after its completion failed", job.action.id)
            started = []
        self._finish(job, result, placement, exec_s)
        self._launch(started)

    def _finish(self, job: Job, result: ExecResult, placement: Placement | None, exec_s: float) -> None:
        a = job.action
        rec = self.engine.finished.get(a.id)
        queued = job.held_s
        if rec is not None and rec.started_at is not None:
            # runs stopped to restart it wider are not queueing: they show as overhead
            queued += max(0.0, rec.started_at - job.enqueued_at - rec.restarted_s)
        elif rec is not None:
            queued += max(0.0, rec.finished_at - job.enqueued_at)
        if job.env is not None:
            job.env.active.discard(a.id)
        total = self.clock() - job.received_at
        timing = Timing(queued_s=queued, exec_s=exec_s, overhead_s=max(0.0, total - queued - exec_s))
        outcome = ActionOutcome(
            id=a.id, status=result.status, exit_code=result.exit_code, stdout=result.stdout,
            stderr=result.stderr, output=result.output, error=result.error,
            allocation=allocation_of(placement, result.isolation, rec.restarted_s if rec else 0), timing=timing,
            truncated=result.truncated, retryable=result.node_down and result.status == FAILED)
        job.outcome = outcome
        job.task = None
        if not job.done.done():
            job.done.set_result(outcome)
        self.statistics.record(job.kind, a.action_class, outcome.status, total, timing.overhead_s)
        for cb in self.listeners:
            try:
                cb(job, outcome)
            except Exception:  # noqa: BLE001 - metrics must never break the driver
                log.exception("runtime listener failed")
        self._finished.append(a.id)
        while len(self._finished) > self._keep_results:
            self._jobs.pop(self._finished.popleft(), None)

    # ------------------------------------------------------------------ #
    # quota refills

    def _arm_wakeup(self) -> None:
        """Make sure a timer runs ``engine.tick()`` at ``engine.next_wakeup()``."""
        if self._closed or not self.engine.waiting:
            return
        # units that came back since the last round read the pools are due now: their own time has passed
        at = self.clock() if self.engine.refilled_unseen() else self.engine.next_wakeup()
        if at is None or (self._wakeup_at is not None and self._wakeup_at <= at and self._wakeup is not None):
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        loop = asyncio.get_running_loop()
        self._wakeup_at = at
        self._wakeup = loop.call_later(max(0.0, at - self.clock()) + 1e-4, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = self._wakeup_at = None
        self.tick()

    # ------------------------------------------------------------------ #
    # environments

    async def create_environment(self, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None, env_id: str | None = None,
                                 network: bool = False) -> str:
        """Register a trajectory's environment; its memory is reserved on the node of its first action
        (a networked one where not every node gives a network: now, on one that does, and made there)."""
        pools = self.engine.pool_states()
        caps = [p.capacity for p in pools.values() if p.rtype == "mem"]
        env_id = await self.env_registry.create(image=image, memory_mb=memory_mb, labels=labels, env_id=env_id,
                                                largest_node_mb=max(caps) if caps else None, network=network)
        if network and len(self.env_executors) > 1 and not all(getattr(ex, "allow_network", False)
                                                               for ex in self.env_executors.values()):
            node = network_node(self.env_executors, {p.node: p.free for p in pools.values() if p.rtype == "mem"},
                                memory_mb)
            try:
                if node is None:
                    raise UnavailableError("network", f"no node that gives a network has {memory_mb} MiB free now", 5)
                self.engine.place_trajectory(env_id, node, memory_mb)  # the first action goes there too
                await self.env_registry.ensure_created(self.env_registry.visible(env_id), node)
            except BaseException:
                await quietly(self.delete_environment(env_id), f"removing environment {env_id} after its creation")
                raise
        return env_id

    def environment(self, env_id: str) -> Environment:
        return self.env_registry.visible(env_id)

    def environments(self) -> list[Environment]:
        return self.env_registry.listed()

    async def delete_environment(self, env_id: str) -> None:
        """Cancel its actions, release its memory reservation and remove it from its node."""
        env = self.env_registry.remove(env_id)
        tasks = []
        for aid in list(env.active):
            job = self._jobs.get(aid)
            if job is not None and job.outcome is None:
                self.cancel(aid)
                if job.task is not None:
                    tasks += [job.task, *job.stopping]
        if tasks:  # the processes must be dead before the directory or container goes
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.env_registry.destroy(env)
        except BaseException:  # its processes are gone; it stays listed, pinned, for a later DELETE to try again
            self.env_registry.put_back(env)
            raise
        self.close_trajectory(env_id)

    # ------------------------------------------------------------------ #
    # stats and lifecycle

    def stats(self) -> dict[str, Any]:
        """Queue length and utilisation per pool, ACT percentiles per action class."""
        return self.statistics.report(self.engine, len(self.environments()))

    def check_whole(self) -> None:
        """Raise AssertionError unless nothing is running and no unit is held (tests, shutdown)."""
        self.engine.check_invariants()
        invariant(not self.engine.running, f"still running: {sorted(self.engine.running)}")
        held = {p: h for m in self.engine.managers for p, h in m.held().items() if h}
        live = {e.id for e in self.env_registry.all()}
        held = {p: h for p, h in held.items() if not p.startswith("mem@") or set(h) - live}
        invariant(not held, f"units still held: {held}")

    async def close(self) -> None:
        """Cancel everything, wait for the executors to kill their work, remove the environments."""
        if self._closed:
            return
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        tasks, started, gone = [], [], ExecResult(status=CANCELLED, error="service shutting down")
        for aid, job in list(self._jobs.items()):
            if job.outcome is None:
                if aid in self.engine.waiting:
                    started += self.engine.cancel(aid)
                    self._finish(job, gone, None, 0.0)
                elif job.task is not None:
                    self.engine.books.withdraw(aid)
                    tasks.append(job.task)
        while started:  # what a cancel's round started never runs (its job has no task): it ends at once
            s = started.pop()
            started += self.engine.complete(s.record.id, CANCELLED)
            if (job := self._jobs.get(s.record.id)) is not None and job.outcome is None:
                self._finish(job, gone, None, 0.0)
        while tasks:  # until no run is left: a completion meanwhile may have restarted one wider
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks = [t for job in self._jobs.values() for t in (job.task, *job.stopping)
                     if t is not None and not t.done()]
        if self.keep_environments:
            await self.env_registry.close_keeping(self.engine.close_trajectory)
            for ex in self.env_executors.values():
                ex.detach()
        else:
            await self.env_registry.close(self.engine.close_trajectory)
        await self.dispatcher.close()
        for closer in self._closers:
            try:
                await closer()
            except Exception:  # noqa: BLE001
                log.exception("closer failed")

    async def __aenter__(self) -> "Runtime":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ #
    # conveniences for in-process users (demo, profiling, verl)

    async def exec(self, environment: str | None, command: str, *, cpu: Any = 1, profile: str | None = None,
                   timeout_s: float | None = None, restartable: bool = False) -> ActionOutcome:
        action = self.build_action("exec", {"cpu": cpu}, environment=environment, command=command,
                                   profile=profile, timeout_s=timeout_s, restartable=restartable)
        return await self.run(action)
