"""Process-level state shared by the tools, the agent loop and the reward code.

verl builds a tool instance per *call* (``ToolAgentLoop._call_tool`` does
create -> execute -> release every time), so a trajectory's sandbox cannot live
in a tool instance. It lives here instead:

* :class:`TrajectoryRegistry` maps a trajectory key (the agent loop's
  ``tangram_trajectory`` attribute on ``AgentData``, else verl's
  ``request_id``) to the id of its Tangram environment. The environment is
  created on the trajectory's first action (``ensure``), reused by every later
  action of the same trajectory (files persist between turns, cores do not:
  the service allocates cores per action) and deleted when the trajectory ends
  (``release``, called by the tangram agent loop). A safety sweep deletes
  environments idle longer than a TTL (trajectories whose loop crashed, or
  plain ``tool_agent`` loops that never release).
* it also collects each trajectory's per-action timings (queued / exec /
  overhead); the tools hand them to verl in ``extra_fields["tangram_trace"]``.
* :func:`get_client` keeps one :class:`tangram.client.TangramClient` per
  (url, token, event loop): an aiohttp session is bound to its loop.
* :func:`retrying` retries transient service errors within a deadline, and
  reports a call that failed so to :mod:`integrations.verl.guard` (which
  counts the service's failures; only a verdict, which the callers report,
  resets it);
  :func:`delete_environment` deletes with retries and never forgets an
  environment it could not delete (:data:`PENDING_DELETES`, retried on every
  later delete and by the sweep).

No verl import here.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from integrations.verl import guard
from integrations.verl.config import TangramSettings
from tangram.client import ActionResult, TangramClient, TangramHTTPError

log = logging.getLogger("integrations.verl")
T = TypeVar("T")

# the service's answers worth another try: not reachable (status 0, but not a deadline that
# passed: the action may be running) and the gateway / overload statuses
_TRANSIENT = frozenset({0, 502, 503, 504})


class TangramServiceError(RuntimeError):
    """The service could not do what a trajectory or its reward needed (after retries).

    Raised instead of a made-up reward: verl's default (``use_v1``) path marks the
    sample's group failed and goes on (:mod:`integrations.verl.guard` stops the run
    once the service keeps failing, ``max_consecutive_failures``), the legacy path
    stops the step."""

# ---------------------------------------------------------------------------- #
# clients

_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None], TangramClient]]" = (
    weakref.WeakKeyDictionary()
)


def get_client(settings: TangramSettings) -> TangramClient:
    """The shared client of this event loop for ``settings.url`` / ``settings.token``."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    key = (settings.url.rstrip("/"), settings.token, settings.token_file, settings.request_timeout_s,
           settings.admission_wait_s, settings.job)
    c = per_loop.get(key)
    if c is None or c._closed:
        # a rollout sends more actions than the service queues: one refused for now waits (Retry-After)
        c = per_loop[key] = TangramClient(settings.url, token=settings.token, token_file=settings.token_file,
                                          timeout_s=settings.request_timeout_s,
                                          admission_wait_s=settings.admission_wait_s, job=settings.job)
    return c


def transient(exc: BaseException, resendable: bool = True) -> bool:
    """Whether another try may help: a gateway or overload status, or a service not reached (not a deadline
    that passed: the action may be running). A request that is not ``resendable`` (a POST that makes
    something, with no Idempotency-Key) only when it was never sent."""
    return (isinstance(exc, TangramHTTPError) and exc.status in _TRANSIENT and not exc.timed_out
            and (resendable or exc.never_sent))


def new_key() -> str:
    """An Idempotency-Key for one action, kept across its retries: the service runs it once."""
    return f"verl-{uuid.uuid4().hex}"


async def retrying(call: Callable[[], Awaitable[T]], settings: TangramSettings, what: str, *,
                   resendable: bool = True, report: bool = True) -> T:
    """``await call()``, retried on transient service errors for up to ``settings.retry_s`` after the first;
    then a :class:`TangramServiceError` naming the service, what was being done and why.
    ``resendable``: the call may reach the service twice without harm (a GET, a DELETE, an action
    POSTed under one Idempotency-Key); otherwise it is tried again only when it was never sent (a
    502 or a reset after sending may have made an environment nobody would delete).
    ``report``: a failure counts in :mod:`~integrations.verl.guard` (when it says the service is
    down), also one a nested ``retrying(..., report=False)`` raised inside ``call``; false for
    what is not the run's work (deletes, a look-up). A success never resets the count: an answer
    does not say the service can run anything; the callers report verdicts."""
    loop = asyncio.get_running_loop()
    deadline: float | None = None  # retry_s from the first error: a call that ran long (a test suite) keeps it all
    delay = 0.25
    tries = 0
    while True:
        tries += 1
        try:
            return await call()
        except TangramServiceError as exc:  # a nested retrying that reports nothing gave up
            if report and not guard.reported(exc):
                guard.mark(exc)
                await guard.failed(settings, exc.__cause__ or exc, what)
            raise
        except TangramHTTPError as exc:
            if deadline is None:
                deadline = loop.time() + max(0.0, settings.retry_s)
            if not transient(exc, resendable) or loop.time() + delay > deadline:
                err = TangramServiceError(f"tangram service {settings.url}: {what} failed after {tries} "
                                          f"tr{'y' if tries == 1 else 'ies'}: {exc}")
                if report:  # in a row, a service that stays down stops the run
                    guard.mark(err)
                    await guard.failed(settings, exc, what)
                raise err from exc
            log.info("tangram: %s: %s (retrying in %.2f s)", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def reward_failed(settings: TangramSettings, exc: BaseException, what: str = "the reward") -> None:
    """A reward raised ``exc``: a :class:`TangramServiceError` no call counted yet (a reward action that did
    not run or gave no verdict) counts in :mod:`~integrations.verl.guard`, once. Other exceptions (a bad
    spec, a cancellation) and errors already counted leave the count."""
    if isinstance(exc, TangramServiceError) and not guard.reported(exc):
        guard.mark(exc)
        await guard.no_result(settings, str(exc), what)


# environments whose delete failed: (settings, env id) -> why; retried, never dropped silently
PENDING_DELETES: dict[tuple[TangramSettings, str], str] = {}


async def delete_environment(settings: TangramSettings, env_id: str) -> bool:
    """Delete ``env_id`` (retried within ``settings.retry_s``); on failure remember it in
    :data:`PENDING_DELETES` for a later try. Also retries the earlier failures. True if deleted."""
    ok = await _delete_once(settings, env_id)
    for (s, e) in [k for k in PENDING_DELETES if k != (settings, env_id)]:
        await _delete_once(s, e, quick=True)
    return ok


async def _delete_once(settings: TangramSettings, env_id: str, quick: bool = False) -> bool:
    key = (settings, env_id)
    try:
        if quick:
            await get_client(settings).delete_environment(env_id)
        else:
            await retrying(lambda: get_client(settings).delete_environment(env_id), settings,
                           f"deleting environment {env_id}", report=False)
    except (TangramHTTPError, TangramServiceError) as exc:
        cause = exc.__cause__ if isinstance(exc, TangramServiceError) else exc
        if isinstance(cause, TangramHTTPError) and cause.status == 404:
            PENDING_DELETES.pop(key, None)
            return True  # gone already
        if key not in PENDING_DELETES:
            log.warning("tangram: could not delete environment %s (kept for a later try): %s", env_id, exc)
        PENDING_DELETES[key] = str(exc)
        return False
    PENDING_DELETES.pop(key, None)
    return True


async def close_clients() -> None:
    """Close this loop's clients (tests, shutdown)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for c in list(_clients.pop(loop, {}).values()):
        await c.close()


# ---------------------------------------------------------------------------- #
# per-trajectory metrics


def timing_record(kind: str, name: str, r: ActionResult) -> dict[str, Any]:
    t = r.timing
    return {
        "kind": kind, "name": name, "status": r.status,
        "queued_s": t.queued_s if t else 0.0, "exec_s": t.exec_s if t else 0.0,
        "overhead_s": t.overhead_s if t else 0.0,
        "admission_wait_s": r.admission_wait_s,
        "dop": (r.allocation or {}).get("dop"),
    }


# ---------------------------------------------------------------------------- #
# trajectory -> environment


@dataclass(slots=True)
class EnvSpec:
    """How to build a trajectory's environment (from the sample or the tool YAML)."""

    image: str | None = None
    memory_mb: int | None = None
    setup_command: str | None = None      # run once, right after the environment is created
    labels: dict[str, str] = field(default_factory=dict)

    def filled_from(self, other: "EnvSpec") -> "EnvSpec":
        """This spec, its unset fields (and labels it lacks) taken from ``other``."""
        return EnvSpec(image=self.image if self.image is not None else other.image,
                       memory_mb=self.memory_mb if self.memory_mb is not None else other.memory_mb,
                       setup_command=self.setup_command if self.setup_command is not None else other.setup_command,
                       labels={**other.labels, **self.labels})

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None, base: "EnvSpec | None" = None) -> "EnvSpec":
        b = base or cls()
        d = dict(d or {})
        return cls(
            image=d.get("image", b.image),
            memory_mb=d.get("memory_mb", b.memory_mb),
            setup_command=d.get("setup_command", b.setup_command),
            labels={**b.labels, **{str(k): str(v) for k, v in (d.get("labels") or {}).items()}},
        )


@dataclass(slots=True)
class _Traj:
    settings: TangramSettings
    spec: EnvSpec
    env_id: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    records: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock | None = None


class TrajectoryRegistry:
    """trajectory key -> environment id, plus per-trajectory action timings."""

    def __init__(self, *, sweep_every_s: float = 30.0):
        self._t: dict[str, _Traj] = {}
        self._sweep_every_s = sweep_every_s
        self._last_sweep = time.monotonic()
        self.created = 0
        self.released = 0

    # -- bookkeeping ----------------------------------------------------- #

    def declare(self, key: str, settings: TangramSettings, spec: EnvSpec | None = None) -> None:
        """Say how ``key``'s environment is to be built (nothing is created yet)."""
        t = self._t.get(key)
        if t is None:
            self._t[key] = _Traj(settings=settings, spec=spec or EnvSpec())
        else:
            t.settings = settings
            if spec is not None and t.env_id is None:
                t.spec = spec

    def settings_of(self, key: str) -> TangramSettings | None:
        """The settings of the service that holds ``key``'s environment."""
        t = self._t.get(key)
        return t.settings if t else None

    def environment_of(self, key: str) -> str | None:
        t = self._t.get(key)
        return t.env_id if t else None

    def keys(self) -> list[str]:
        return list(self._t)

    def live_environments(self) -> dict[str, str]:
        return {k: t.env_id for k, t in self._t.items() if t.env_id}

    def record(self, key: str, kind: str, name: str, r: ActionResult) -> dict[str, Any]:
        rec = timing_record(kind, name, r)
        t = self._t.get(key)
        if t is not None:
            t.records.append(rec)
            t.last_used = time.monotonic()
        return rec

    def records(self, key: str) -> list[dict[str, Any]]:
        t = self._t.get(key)
        return list(t.records) if t else []

    # -- lifecycle -------------------------------------------------------- #

    async def ensure(self, key: str, settings: TangramSettings | None = None, spec: EnvSpec | None = None) -> str:
        """The environment of trajectory ``key``; created (and set up) on first use."""
        await self.maybe_sweep()
        t = self._t.get(key)
        if t is None:
            if settings is None:
                raise ValueError(f"trajectory {key!r} was never declared and no settings were given")
            self.declare(key, settings, spec)
            t = self._t[key]
        elif t.env_id is None:
            if spec is not None:  # the sample's fields win; what it leaves out comes from the tool's YAML
                t.spec = t.spec.filled_from(spec)
            if settings is not None:
                t.settings = settings  # the first tool to need it says which service holds it
        t.last_used = time.monotonic()
        if t.env_id is not None:
            return t.env_id
        if t.lock is None:
            t.lock = asyncio.Lock()
        async with t.lock:  # parallel tool calls of one turn share one environment
            if t.env_id is not None:
                return t.env_id
            # the rollout's API calls so far named it by its key: they count as this environment's
            env_id, setup = await create_environment(t.settings, t.spec, labels={"trajectory": key[:200]},
                                                     trajectory=key[:256])
            t.env_id = env_id
            if setup is not None:
                self.record(key, "exec", "setup", setup)
            self.created += 1
            log.debug("tangram: trajectory %s -> environment %s", key, env_id)
            return env_id

    def hand_over(self, key: str) -> str | None:
        """Forget trajectory ``key`` without deleting its environment (whoever scores it deletes it)."""
        t = self._t.pop(key, None)
        return t.env_id if t is not None else None

    async def release(self, key: str) -> bool:
        """Delete trajectory ``key``'s environment (if any) and forget the trajectory; a failed delete
        is kept in :data:`PENDING_DELETES` and retried later. Idempotent."""
        t = self._t.pop(key, None)
        if t is None or t.env_id is None:
            return False
        ok = await delete_environment(t.settings, t.env_id)
        if ok:
            self.released += 1
        return ok

    async def sweep(self, ttl_s: float | None = None) -> list[str]:
        """Release every environment idle for more than its TTL; returns the released keys."""
        now = time.monotonic()
        self._last_sweep = now
        stale = [k for k, t in self._t.items()
                 if now - t.last_used > (ttl_s if ttl_s is not None else t.settings.env_ttl_s)
                 and not (t.lock is not None and t.lock.locked())]
        for k in stale:
            log.info("tangram: releasing idle environment of trajectory %s (TTL)", k)
            await self.release(k)
        for (s, e) in list(PENDING_DELETES):
            await _delete_once(s, e, quick=True)
        return stale

    async def maybe_sweep(self) -> None:
        if time.monotonic() - self._last_sweep >= self._sweep_every_s:
            await self.sweep()


async def create_environment(settings: TangramSettings, spec: EnvSpec, labels: Mapping[str, str] = {},
                             trajectory: str | None = None) -> tuple[str, ActionResult | None]:
    """A new environment built per ``spec`` and the result of its ``setup_command`` (if any); raises
    :class:`TangramServiceError` if the service cannot create it or the setup fails
    (the environment is then deleted again)."""
    client = get_client(settings)
    tag = {"verl-request": new_key()}  # finds the environment a lost answer made, before sending again

    async def create() -> str:
        try:
            return await client.create_environment(
                image=spec.image or settings.image,
                memory_mb=spec.memory_mb if spec.memory_mb is not None else settings.memory_mb,
                labels={**labels, **spec.labels, **tag}, trajectory=trajectory)
        except TangramHTTPError as exc:
            if exc.status in _TRANSIENT and not exc.never_sent:  # it may have been made (also past the
                # deadline): look, retrying the look itself, before anything is sent again
                # (not counted: its failure is the creation's, which the outer retrying counts)
                listed = await retrying(lambda: client._request("GET", "/v1/environments"), settings,
                                        "looking for an environment whose creation lost its answer", report=False)
                made = [e["id"] for e in listed.get("environments", [])
                        if (e.get("labels") or {}).items() >= tag.items()]
                if made:
                    return made[0]
            raise

    env_id = await retrying(create, settings, "creating an environment")
    if spec.setup_command:
        try:
            key = new_key()
            r = await retrying(lambda: client.exec(env_id, spec.setup_command, cpu=1, idempotency_key=key,
                                                   timeout_s=settings.tool_timeout_s),
                               settings, f"setup_command in environment {env_id}")
        except BaseException:
            await delete_environment(settings, env_id)
            raise
        if not (r.ok and r.exit_code in (0, None)):
            err = TangramServiceError(
                f"tangram service {settings.url}: setup_command failed in environment {env_id} "
                f"({r.status}, exit code {r.exit_code}): {(r.stderr or r.error or r.stdout or '')[-500:]}")
            guard.mark(err)  # the sample's work cannot be done: counted here, once
            await guard.no_result(settings, guard.did_not_run(r, "exec") or str(err),
                                  f"setup_command in environment {env_id}")
            await delete_environment(settings, env_id)
            raise err
        return env_id, r
    return env_id, None


REGISTRY = TrajectoryRegistry()
