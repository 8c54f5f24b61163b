"""The async driver of one :class:`~tangram.core.engine.Engine` (DESIGN.md §2, §6).

The engine is synchronous and never touches the world; this module is the
other half: it owns the engine (real clock), the managers inside it and the
executors, and turns every :class:`~tangram.core.engine.Started` into an
asyncio task that

1. builds a :class:`~tangram.executors.base.Placement` from the grants
   (cores of ``cpu@node``, the buddy chunk of ``gpu@node``),
2. renders ``${parallel_num}`` and sets ``TANGRAM_DOP``,
3. runs the action on the executor of its kind (``exec`` -> the node's
   environment executor, ``http`` -> the HTTP executor, ``model`` -> the
   node's GPU executor) under ``timeout_s``,
4. reports back with :meth:`Engine.complete` *after* the executor returned
   (so the process is dead before its cores are reused) and dispatches what
   starts next.

Quota refills wake the engine at :meth:`Engine.next_wakeup` with
:meth:`Engine.tick`. Cancellation (``Runtime.cancel`` or the awaiting task
being cancelled) kills a running action through its executor; an executor
crash becomes ``failed``; in every case each grant is released exactly once.

No aiohttp here: the service, the demo, the profiler and the verl
integration all drive this class in-process.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping

from tangram.core.engine import WAITING, Engine, Started
from tangram.core.errors import DemandError, TangramError, UnknownActionError, UnschedulableError
from tangram.core.model import Action, Profile, render_command
from tangram.executors.base import CANCELLED, FAILED, SUCCEEDED, TIMEOUT, EnvironmentExecutor, ExecResult, Placement
from tangram.managers.buddy import Chunk

log = logging.getLogger("tangram.runtime")

KINDS = ("exec", "http", "model")
# the executor is trusted to honour timeout_s itself; past this much more the runtime cancels it
TIMEOUT_GRACE_S = 2.0
# an http action without timeout_s is re-queued after upstream 429s until this long after it was received
HTTP_429_DEADLINE_S = 600.0
_RECENT = 10_000  # samples kept per class for percentiles


class UnknownEnvironmentError(TangramError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown environment"


class ExecutorFailedError(TangramError):
    """An executor could not do its part outside of any action (e.g. creating an environment)."""


class ExecutorMissingError(DemandError):
    """The action's kind has no executor configured (e.g. ``model`` without GPUs)."""


# ---------------------------------------------------------------------------- #
# results


@dataclass(slots=True)
class Timing:
    """Where an action's time went (seconds).

    ``queued_s``: waiting for resources (from the end of the submit round to
    the round that started it; 0 if it started at once).
    ``exec_s``: the executor's own run (the process / call / model batch).
    ``overhead_s``: everything else the system spent between receiving the
    action and having its result: parsing, the policy rounds, environment
    setup, cgroup placement, bookkeeping.
    """

    queued_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"queued_s": self.queued_s, "exec_s": self.exec_s, "overhead_s": self.overhead_s}


@dataclass(slots=True)
class ActionOutcome:
    """The finished result of one action (the wire API's result object)."""

    id: str
    status: str
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    output: Any = None
    error: str | None = None
    allocation: dict[str, Any] = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "status": self.status}
        for k in ("exit_code", "stdout", "stderr", "output", "error"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        d["allocation"] = self.allocation
        d["timing"] = self.timing.as_dict()
        return d


@dataclass(slots=True)
class Environment:
    """A trajectory's environment: created lazily on the node of its first action."""

    id: str
    image: str | None = None
    memory_mb: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    created: dict[str, "asyncio.Task[None]"] = field(default_factory=dict)  # node -> creation
    active: set[str] = field(default_factory=set)  # unfinished action ids
    oneshot: bool = False


class _Job:
    """Runtime-side state of one submitted action."""

    __slots__ = ("action", "kind", "received_at", "enqueued_at", "task", "done", "outcome",
                 "env", "timed_out", "requeues")

    def __init__(self, action: Action, kind: str, received_at: float, env: Environment | None):
        self.action = action
        self.kind = kind
        self.received_at = received_at
        self.enqueued_at = received_at
        self.task: asyncio.Task | None = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.outcome: ActionOutcome | None = None
        self.env = env
        self.timed_out = False
        self.requeues = 0  # upstream 429s absorbed for this action


# ---------------------------------------------------------------------------- #


class Runtime:
    """One engine, its managers and executors, driven on the running event loop.

    ``env_executors`` maps each CPU node to the executor of its environments;
    ``model_executors`` maps each GPU node to an object with
    ``async run(action, placement, *, timeout_s) -> ExecResult`` (or a
    single such object for every node); ``http_executor`` has
    ``async run(request, *, timeout_s) -> ExecResult``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
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
        self.env_executors: dict[str, EnvironmentExecutor] = dict(env_executors or {})
        self.http_executor = http_executor
        self.model_executors = model_executors
        # the models the GPU nodes can serve (None: unchecked); an unknown one never reaches a manager
        self.models: frozenset[str] | None = None if models is None else frozenset(models)
        self.profiles: dict[str, Profile] = dict(profiles or {})
        self._keep_results = keep_results
        self._closers = list(closers)
        self._jobs: dict[str, _Job] = {}
        self._finished: deque[str] = deque()  # finished job ids, oldest first (bounded retention)
        self._envs: dict[str, Environment] = {}
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at: float | None = None
        self._closed = False
        self._cleanups: set[asyncio.Task] = set()
        self._act: dict[str, deque[float]] = {}
        self._overhead: deque[float] = deque(maxlen=_RECENT)
        self.counts: dict[tuple[str, str], int] = {}  # (kind, status) -> n
        self.upstream_429s_absorbed: dict[str, int] = {}  # API pool -> 429s re-queued instead of returned
        self.listeners: list[Callable[[_Job, ActionOutcome], None]] = []

    @classmethod
    async def from_config(cls, config: Any = None) -> "Runtime":
        """The runtime of a :class:`tangram.service.config.ClusterConfig` (None: this machine).

        For in-process users (demo, profiling, verl): ``async with await Runtime.from_config() as rt``.
        """
        from tangram.service.build import build_runtime
        from tangram.service.config import default_config

        return await build_runtime(config or default_config())

    # ------------------------------------------------------------------ #
    # building actions

    def cpu_nodes(self) -> list[str]:
        return [p.node for p in self.engine.pool_states().values() if p.rtype == "cpu" and p.node]

    def build_action(
        self,
        kind: str,
        resources: Mapping[str, Any] | None = None,
        *,
        environment: str | None = None,
        command: str | None = None,
        profile: str | None = None,
        timeout_s: float | None = None,
        action_class: str | None = None,
        payload: Mapping[str, Any] | None = None,
        action_id: str | None = None,
    ) -> Action:
        """Validate and build an action; raises DemandError (naming the field) or UnknownEnvironmentError."""
        if kind not in KINDS:
            raise DemandError("kind", f"must be one of {list(KINDS)}, got {kind!r}")
        res = dict(resources or {})
        demands: dict[str, Any] = {}
        for key, raw in res.items():
            if key in ("cpu", "gpu"):
                demands[key] = raw
            elif key == "api":
                if not isinstance(raw, str) or not raw:
                    raise DemandError("resources.api", f"must be an API pool name, got {raw!r}")
                pool = raw if raw.startswith("api:") else f"api:{raw}"
                if pool not in self.engine.pool_states():
                    raise UnschedulableError("resources.api", f"no API pool named {pool[4:]!r} is configured")
                demands[pool] = 1
            elif key != "mem_mb":
                raise DemandError(f"resources.{key}", "unknown resource (expected cpu, gpu, api or mem_mb)")
        mem_mb = res.get("mem_mb", 0)
        if isinstance(mem_mb, bool) or not isinstance(mem_mb, int) or mem_mb < 0:
            raise DemandError("resources.mem_mb", f"must be a non-negative integer, got {mem_mb!r}")
        body = dict(payload or {})
        body["kind"] = kind
        if kind == "exec":
            if not isinstance(command, str) or not command.strip():
                raise DemandError("command", "an exec action needs a non-empty command string")
            body["command"] = command
            demands.setdefault("cpu", 1)
            if "gpu" in demands:
                raise DemandError("resources.gpu", "an exec action runs on CPU cores; use kind 'model' for GPUs")
        elif kind == "http":
            if not any(k.startswith("api:") for k in demands):
                apis = [p.name for p in self.engine.pool_states().values() if p.rtype.startswith("api:")]
                if len(apis) != 1:
                    raise DemandError("resources.api", "an http action needs the name of its API pool")
                demands[apis[0]] = 1
        elif kind == "model":
            demands.setdefault("gpu", 1)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise DemandError("model", "a model action names its model")
            if self.models is not None and model not in self.models:
                raise DemandError("model", f"unknown model {model!r} (served: {sorted(self.models)})")
        if environment is not None and kind != "exec":
            raise DemandError("environment", "only exec actions run inside an environment")
        env = None
        if environment is not None:
            env = self._envs.get(environment)
            if env is None:
                raise UnknownEnvironmentError(f"environment {environment!r} is unknown")
            mem_mb = env.memory_mb
        prof = None
        if profile is not None:
            prof = self.profiles.get(profile)
            if prof is None:
                raise DemandError("profile", f"unknown profile {profile!r}")
        action = Action.build(
            action_id or uuid.uuid4().hex,
            demands,
            action_class=action_class or profile or kind,
            trajectory=environment,
            profile=prof,
            mem_mb=mem_mb,
            timeout_s=timeout_s,
            service=body.get("model") if kind == "model" else None,
            payload=body,
        )
        # checked after the demand itself, so a malformed demand is a 400 whatever is configured
        if kind == "http" and self.http_executor is None:
            raise ExecutorMissingError("kind", "no HTTP executor is configured")
        if kind == "model" and self.model_executors is None:
            raise ExecutorMissingError("kind", "no GPU model executor is configured")
        return action

    # ------------------------------------------------------------------ #
    # running actions

    def submit(self, action: Action, *, received_at: float | None = None) -> str:
        """Queue ``action``; returns its id at once (raises UnschedulableError for a demand that can never fit)."""
        if self._closed:
            raise RuntimeError("the runtime is closed")
        received_at = self.clock() if received_at is None else received_at
        kind = action.payload.get("kind", "exec")
        env = None
        if action.trajectory is not None:
            env = self._envs.get(action.trajectory)
            if env is None:
                raise UnknownEnvironmentError(f"environment {action.trajectory!r} is unknown")
        if action.id in self._jobs:
            raise UnschedulableError("id", f"action {action.id!r} was already submitted")
        job = _Job(action, kind, received_at, env)
        self._jobs[action.id] = job
        try:
            started = self.engine.submit(action)
        except BaseException:
            del self._jobs[action.id]
            raise
        job.enqueued_at = self.clock()
        if env is not None:
            env.active.add(action.id)
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
            job.task.cancel()  # the task kills the process, then completes the engine
        return True

    def _job(self, action_id: str) -> _Job:
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
            job.task = loop.create_task(self._execute(job, s))
            job.task.add_done_callback(functools.partial(self._task_done, job))
        self._arm_wakeup()

    def _task_done(self, job: _Job, task: asyncio.Task) -> None:
        # A task cancelled before its first step never ran its body: complete it here,
        # so no grant outlives it. (A task whose call was re-queued is no longer the job's.)
        if job.outcome is None and job.task is task:
            self._complete(job, ExecResult(status=CANCELLED, error="cancelled before it started"), None, 0.0)
            if job.env is not None and job.env.oneshot:
                self._background(self._drop_oneshot(job.env))

    async def _execute(self, job: _Job, s: Started) -> None:
        a = job.action
        placement: Placement | None = None
        exec_s = 0.0
        try:
            placement = self._placement(s)
            await self._prepare(job, placement)  # environment set-up is overhead, not the action's run
            t0 = self.clock()
            try:
                result = await self._run_executor(job, s, placement)
            finally:
                exec_s = self.clock() - t0
            # an executor that measures its own run (without its setup) is more precise
            own = result.details.get("exec_s") if result.details else None
            if isinstance(own, (int, float)) and 0 <= own <= exec_s:
                exec_s = float(own)
        except asyncio.CancelledError:
            result = ExecResult(status=TIMEOUT if job.timed_out else CANCELLED,
                                error="timed out" if job.timed_out else "cancelled")
        except TimeoutError:
            result = ExecResult(status=TIMEOUT, error=f"no result within {a.timeout_s:g} s")
        except Exception as exc:  # an executor crash is a failed action, never a leak
            log.warning("action %s: executor failed: %r", a.id, exc)
            result = ExecResult(status=FAILED, error=f"{type(exc).__name__}: {exc}")
        if job.kind == "http" and self._upstream_answer(job, s, result):
            return
        if job.env is not None and job.env.oneshot:
            try:
                await asyncio.shield(self._drop_oneshot(job.env))
            except asyncio.CancelledError:
                pass  # cancelled again while cleaning up: the grants are released below anyway
            except Exception:  # noqa: BLE001 - cleanup must not keep the grants
                log.exception("action %s: removing its one-shot environment failed", a.id)
        self._complete(job, result, placement, exec_s)

    async def _run_executor(self, job: _Job, s: Started, placement: Placement) -> ExecResult:
        a = job.action
        p = a.payload
        kind = job.kind
        timeout_s = a.timeout_s
        if kind == "exec":
            executor = self.env_executors[placement.node]
            env = job.env
            extra = {"stdin": p["stdin"]} if p.get("stdin") is not None else {}  # only executors that take input
            coro = executor.exec(env.id, render_command(p["command"], placement.dop), placement,
                                 timeout_s=timeout_s, env={"TANGRAM_DOP": str(placement.dop), **p.get("env", {})},
                                 **extra)
        elif kind == "http":
            req = {k: p[k] for k in ("url", "method", "headers", "json", "body") if k in p}
            coro = self.http_executor.run(req, timeout_s=timeout_s)
        elif kind == "model":
            executor = self._model_executor(placement.node)
            coro = executor.run(a, placement, timeout_s=timeout_s)
        else:
            raise RuntimeError(f"unknown action kind {kind!r}")
        if timeout_s is None:
            return await coro
        # safety net: an executor that ignores timeout_s is cancelled (and must kill) a bit later
        try:
            async with asyncio.timeout(timeout_s + TIMEOUT_GRACE_S):
                return await coro
        except TimeoutError:
            job.timed_out = True
            raise

    def _upstream_answer(self, job: _Job, s: Started, result: ExecResult) -> bool:
        """Hand the upstream's answer to its pool's manager; True if a 429 was re-queued instead of returned.

        The manager pauses the pool for the advertised delay; the action goes
        back to the head of the queue unless that delay would pass its
        deadline (``timeout_s`` after it was received, else ``HTTP_429_DEADLINE_S``).
        """
        out = result.output if isinstance(result.output, Mapping) else {}
        status = out.get("status")
        headers = (result.details or {}).get("headers") or {}
        delay = None
        pool = None
        for name in s.grants:
            observe = getattr(self.engine.manager_of(name), "observe_response", None)
            if name.startswith("api:") and observe is not None:
                d = observe(name, status, headers)
                if d is not None and (delay is None or d > delay):
                    delay, pool = d, name
        if status != 429 or delay is None or job.outcome is not None:
            return False
        budget = job.action.timeout_s if job.action.timeout_s is not None else HTTP_429_DEADLINE_S
        if self.clock() + delay >= job.received_at + budget:
            return False
        job.requeues += 1
        self.upstream_429s_absorbed[pool] = self.upstream_429s_absorbed.get(pool, 0) + 1
        log.info("action %s: upstream 429 on %s, re-queued (pause %.3g s)", job.action.id, pool, delay)
        try:
            started = self.engine.requeue(job.action.id)
        except UnknownActionError:  # cancelled meanwhile (close, delete_environment)
            return False
        job.task = None
        self._launch(started)
        return True

    async def _prepare(self, job: _Job, placement: Placement) -> None:
        """Make sure an exec action's environment exists on its node (a one-shot one is made now)."""
        if job.kind != "exec":
            return
        if placement.node is None or placement.node not in self.env_executors:
            raise RuntimeError(f"node {placement.node!r} has no environment executor")
        env = job.env
        if env is None:  # a one-shot environment, removed after the action
            a = job.action
            env = job.env = Environment(id=f"oneshot-{a.id}", memory_mb=a.mem_mb, oneshot=True)
            self._envs[env.id] = env
        await self._ensure_created(env, placement.node)

    def _model_executor(self, node: str | None) -> Any:
        ex = self.model_executors
        if isinstance(ex, Mapping):
            ex = ex.get(node)
        if ex is None:
            raise RuntimeError(f"node {node!r} has no GPU model executor")
        return ex

    @staticmethod
    def _placement(s: Started) -> Placement:
        d = s.dispatch
        cores: tuple[int, ...] = ()
        gpus: tuple[int, ...] = ()
        for pname, grant in s.grants.items():
            if pname.startswith("cpu@"):
                cores = _cores_of(grant)
            elif pname.startswith("gpu@"):
                gpus = _devices_of(grant)
        return Placement(action_id=s.record.id, node=d.node, dop=d.dop, cores=cores, gpu_devices=gpus,
                         grants=dict(s.grants))

    def _complete(self, job: _Job, result: ExecResult, placement: Placement | None, exec_s: float) -> None:
        try:
            started = self.engine.complete(job.action.id, result.status)
        except UnknownActionError:  # already cancelled in the engine (close, delete_environment)
            started = []
        except Exception:  # noqa: BLE001 - the grants were released before the policy ran; keep driving
            log.exception("action %s: scheduling after its completion failed", job.action.id)
            started = []
        self._finish(job, result, placement, exec_s)
        self._launch(started)

    def _finish(self, job: _Job, result: ExecResult, placement: Placement | None, exec_s: float) -> None:
        a = job.action
        rec = self.engine.finished.get(a.id)
        queued = 0.0
        if rec is not None and rec.started_at is not None:
            queued = max(0.0, rec.started_at - job.enqueued_at)
        elif rec is not None:
            queued = max(0.0, rec.finished_at - job.enqueued_at)
        alloc: dict[str, Any] = {}
        if placement is not None:
            alloc = {"node": placement.node, "dop": placement.dop}
            if placement.cores:
                alloc["cores"] = list(placement.cores)
            if placement.gpu_devices:
                alloc["gpus"] = list(placement.gpu_devices)
            apis = [p for p in placement.grants if p.startswith("api:")]
            if apis:
                alloc["api"] = apis[0][4:]
            if result.details:
                iso = result.details.get("isolation")
                if iso is not None:
                    alloc["isolation"] = iso
        if job.env is not None:
            job.env.active.discard(a.id)
        total = self.clock() - job.received_at
        timing = Timing(queued_s=queued, exec_s=exec_s, overhead_s=max(0.0, total - queued - exec_s))
        outcome = ActionOutcome(
            id=a.id, status=result.status, exit_code=result.exit_code, stdout=result.stdout,
            stderr=result.stderr, output=result.output, error=result.error, allocation=alloc, timing=timing,
        )
        job.outcome = outcome
        job.task = None
        if not job.done.done():
            job.done.set_result(outcome)
        self._record_stats(job, outcome, total)
        self._finished.append(a.id)
        while len(self._finished) > self._keep_results:
            self._jobs.pop(self._finished.popleft(), None)

    def _record_stats(self, job: _Job, outcome: ActionOutcome, total: float) -> None:
        key = (job.kind, outcome.status)
        self.counts[key] = self.counts.get(key, 0) + 1
        if outcome.status == SUCCEEDED:
            self._act.setdefault(job.action.action_class, deque(maxlen=_RECENT)).append(total)
            self._overhead.append(outcome.timing.overhead_s)
        for cb in self.listeners:
            try:
                cb(job, outcome)
            except Exception:  # noqa: BLE001 - metrics must never break the driver
                log.exception("runtime listener failed")

    # ------------------------------------------------------------------ #
    # quota refills

    def _arm_wakeup(self) -> None:
        """Make sure a timer runs ``engine.tick()`` at ``engine.next_wakeup()``."""
        if self._closed or not self.engine.waiting:
            return
        at = self.engine.next_wakeup()
        if at is None or (self._wakeup_at is not None and self._wakeup_at <= at and self._wakeup is not None):
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        loop = asyncio.get_running_loop()
        self._wakeup_at = at
        self._wakeup = loop.call_later(max(0.0, at - self.clock()) + 1e-4, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._wakeup_at = None
        if not self._closed:
            self._launch(self.engine.tick())

    # ------------------------------------------------------------------ #
    # environments

    async def create_environment(self, *, image: str | None = None, memory_mb: int = 0,
                                 labels: Mapping[str, str] | None = None, env_id: str | None = None) -> str:
        """Register a trajectory's environment; its memory is reserved on the node of its first action."""
        if image is not None and (not isinstance(image, str) or not image):
            raise DemandError("image", f"must be a non-empty string, got {image!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 0:
            raise DemandError("memory_mb", f"must be a non-negative integer, got {memory_mb!r}")
        if labels is not None and (not isinstance(labels, Mapping)
                                   or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
            raise DemandError("labels", "must be an object of string values")
        if not self.env_executors:
            raise ExecutorMissingError("environment", "no CPU node with an environment executor is configured")
        if memory_mb:
            caps = [p.capacity for p in self.engine.pool_states().values() if p.rtype == "mem"]
            if caps and memory_mb > max(caps):
                raise UnschedulableError("memory_mb", f"needs {memory_mb} MiB, the largest node has {max(caps)}")
        env_id = env_id or f"env-{uuid.uuid4().hex[:16]}"
        if env_id in self._envs:
            raise DemandError("id", f"environment {env_id!r} exists")
        env = Environment(id=env_id, image=image, memory_mb=memory_mb, labels=dict(labels or {}))
        self._envs[env_id] = env
        nodes = list(self.env_executors)
        if len(nodes) == 1:  # one node: the environment can only live there, make it now
            try:
                await self._ensure_created(env, nodes[0])
            except Exception as exc:
                self._envs.pop(env_id, None)
                raise ExecutorFailedError(f"creating environment {env_id} on {nodes[0]!r} failed: "
                                          f"{type(exc).__name__}: {exc}") from exc
            except BaseException:  # the caller went away: the creation goes on, so undo it after
                self._envs.pop(env_id, None)
                self._background(self._destroy(env))
                raise
        return env_id

    def environment(self, env_id: str) -> Environment:
        env = self._envs.get(env_id)
        if env is None or env.oneshot:
            raise UnknownEnvironmentError(f"environment {env_id!r} is unknown")
        return env

    def environments(self) -> list[Environment]:
        return [e for e in self._envs.values() if not e.oneshot]

    async def delete_environment(self, env_id: str) -> None:
        """Cancel its actions, release its memory reservation and remove it from its node."""
        env = self.environment(env_id)
        del self._envs[env_id]
        tasks = []
        for aid in list(env.active):
            job = self._jobs.get(aid)
            if job is not None and job.outcome is None:
                self.cancel(aid)
                if job.task is not None:
                    tasks.append(job.task)
        if tasks:  # the processes must be dead before the directory or container goes
            await asyncio.gather(*tasks, return_exceptions=True)
        self._launch(self.engine.close_trajectory(env_id))
        await self._destroy(env)

    async def _ensure_created(self, env: Environment, node: str) -> None:
        task = env.created.get(node)
        if task is None:
            ex = self.env_executors[node]
            task = asyncio.get_running_loop().create_task(
                ex.create_environment(env.id, image=env.image, memory_mb=env.memory_mb, labels=env.labels))
            env.created[node] = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except BaseException:
            if env.created.get(node) is task:
                del env.created[node]  # let the next action try again
            raise

    async def _destroy(self, env: Environment) -> None:
        for node, task in list(env.created.items()):
            if not task.done():
                try:
                    await task
                except BaseException:  # noqa: BLE001 - a failed creation left nothing to destroy
                    continue
            elif task.cancelled() or task.exception() is not None:
                continue
            await self.env_executors[node].destroy_environment(env.id)
        env.created.clear()

    def _background(self, coro: Awaitable[None]) -> None:
        """Run cleanup detached from the (cancelled) caller, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _drop_oneshot(self, env: Environment) -> None:
        self._envs.pop(env.id, None)
        await self._destroy(env)

    # ------------------------------------------------------------------ #
    # stats and lifecycle

    def stats(self) -> dict[str, Any]:
        """Queue length and utilisation per pool, ACT percentiles per action class."""
        eng = self.engine
        pools = eng.pool_states()
        waiting_by_pool: dict[str, int] = {name: 0 for name in pools}
        for rec in eng.waiting.values():
            a = rec.action
            bound = eng.placement.get(a.trajectory) if a.trajectory else None
            for rtype in a.demands:
                if rtype.startswith("api:"):
                    if rtype in waiting_by_pool:
                        waiting_by_pool[rtype] += 1
                    continue
                for name, p in pools.items():
                    if p.rtype == rtype and (bound is None or p.node == bound):
                        waiting_by_pool[name] += 1
        out_pools = {}
        for name, p in pools.items():
            used = p.capacity - p.free
            out_pools[name] = {
                "type": p.rtype, "node": p.node, "capacity": p.capacity, "free": p.free, "used": used,
                "utilisation": (used / p.capacity) if p.capacity else 0.0,
                "queue_length": waiting_by_pool.get(name, 0),
            }
        classes = {}
        for cls, samples in self._act.items():
            xs = sorted(samples)
            classes[cls] = {"count": len(xs), "act_p50_s": _pct(xs, 50), "act_p90_s": _pct(xs, 90),
                            "act_p99_s": _pct(xs, 99), "mean_exec_s": eng.estimator.mean_duration(cls)}
        ov = sorted(self._overhead)
        return {
            "queue_length": len(eng.waiting),
            "running": len(eng.running),
            "environments": len(self.environments()),
            "pools": out_pools,
            "classes": classes,
            "overhead": {"p50_s": _pct(ov, 50), "p99_s": _pct(ov, 99), "samples": len(ov)},
            "actions": {f"{k}:{s}": n for (k, s), n in sorted(self.counts.items())},
        }

    def check_whole(self) -> None:
        """Raise AssertionError unless nothing is running and no unit is held (tests, shutdown)."""
        self.engine.check_invariants()
        assert not self.engine.running, f"still running: {sorted(self.engine.running)}"
        held = {p: h for m in self.engine.managers for p, h in m.held().items() if h}
        held = {p: h for p, h in held.items() if not p.startswith("mem@")
                or set(h) - {e.id for e in self._envs.values()}}
        assert not held, f"units still held: {held}"

    async def close(self) -> None:
        """Cancel everything, wait for the executors to kill their work, remove the environments."""
        if self._closed:
            return
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        tasks = []
        for aid, job in list(self._jobs.items()):
            if job.outcome is None:
                if aid in self.engine.waiting:
                    self.engine.cancel(aid)
                    self._finish(job, ExecResult(status=CANCELLED, error="service shutting down"), None, 0.0)
                elif job.task is not None:
                    tasks.append(job.task)
                    job.task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)
        for env in list(self._envs.values()):
            try:
                self.engine.close_trajectory(env.id)
                await self._destroy(env)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                log.exception("removing environment %s failed", env.id)
        self._envs.clear()
        for ex in {id(e): e for e in self.env_executors.values()}.values():
            await _maybe_close(ex)
        if self.http_executor is not None:
            await _maybe_close(self.http_executor)
        mex = self.model_executors
        for ex in ({id(e): e for e in mex.values()}.values() if isinstance(mex, Mapping) else [mex] if mex else []):
            await _maybe_close(ex)
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
                   timeout_s: float | None = None) -> ActionOutcome:
        action = self.build_action("exec", {"cpu": cpu}, environment=environment, command=command,
                                   profile=profile, timeout_s=timeout_s)
        return await self.run(action)


async def _maybe_close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is None:
        return
    try:
        r = close()
        if asyncio.iscoroutine(r):
            await r
    except Exception:  # noqa: BLE001 - best effort on shutdown
        log.exception("closing %r failed", obj)


def _cores_of(grant: Any) -> tuple[int, ...]:
    cores = getattr(grant, "cores", grant)
    if isinstance(cores, (tuple, list, set, frozenset, range)):
        return tuple(sorted(int(c) for c in cores))
    return ()  # a plain count (CountingManager): no explicit core set


def _devices_of(grant: Any) -> tuple[int, ...]:
    chunk = getattr(grant, "chunk", grant)
    if isinstance(chunk, Chunk):
        return tuple(chunk.devices)
    devices = getattr(grant, "devices", None)
    if devices is not None:
        return tuple(int(d) for d in devices)
    return ()


def _pct(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    k = min(len(sorted_xs) - 1, max(0, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]
