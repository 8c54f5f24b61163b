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
  overhead) so the agent loop can hand them back to verl.
* :func:`get_client` keeps one :class:`tangram.client.TangramClient` per
  (url, token, event loop): an aiohttp session is bound to its loop.

No verl import here.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from integrations.verl.config import TangramSettings
from tangram.client import ActionResult, TangramClient, TangramHTTPError

log = logging.getLogger("integrations.verl")

# ---------------------------------------------------------------------------- #
# clients

_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None], TangramClient]]" = (
    weakref.WeakKeyDictionary()
)


def get_client(settings: TangramSettings) -> TangramClient:
    """The shared client of this event loop for ``settings.url`` / ``settings.token``."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    key = (settings.url.rstrip("/"), settings.token)
    c = per_loop.get(key)
    if c is None or c._closed:
        c = per_loop[key] = TangramClient(settings.url, token=settings.token)
    return c


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
        "dop": (r.allocation or {}).get("dop"),
    }


def summarize(records: list[Mapping[str, Any]]) -> dict[str, float]:
    """Flat per-trajectory totals (what goes into verl's extra_fields, one batch column each)."""
    out = {"tangram_actions": float(len(records)), "tangram_total_queued_s": 0.0, "tangram_total_exec_s": 0.0,
           "tangram_total_overhead_s": 0.0, "tangram_failed_actions": 0.0}
    for r in records:
        out["tangram_total_queued_s"] += float(r.get("queued_s") or 0.0)
        out["tangram_total_exec_s"] += float(r.get("exec_s") or 0.0)
        out["tangram_total_overhead_s"] += float(r.get("overhead_s") or 0.0)
        if r.get("status") != "succeeded":
            out["tangram_failed_actions"] += 1.0
    return out


# ---------------------------------------------------------------------------- #
# trajectory -> environment


@dataclass(slots=True)
class EnvSpec:
    """How to build a trajectory's environment (from the sample or the tool YAML)."""

    image: str | None = None
    memory_mb: int | None = None
    setup_command: str | None = None      # run once, right after the environment is created
    labels: dict[str, str] = field(default_factory=dict)

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
    setup_result: ActionResult | None = None


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

    def add_record(self, key: str, rec: dict[str, Any]) -> None:
        t = self._t.get(key)
        if t is not None:
            t.records.append(dict(rec))
            t.last_used = time.monotonic()

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
        elif spec is not None and t.env_id is None and t.spec == EnvSpec():
            t.spec = spec
        t.last_used = time.monotonic()
        if t.env_id is not None:
            return t.env_id
        if t.lock is None:
            t.lock = asyncio.Lock()
        async with t.lock:  # parallel tool calls of one turn share one environment
            if t.env_id is not None:
                return t.env_id
            client = get_client(t.settings)
            labels = {"trajectory": key[:200], **t.spec.labels}
            env_id = await client.create_environment(
                image=t.spec.image or t.settings.image,
                memory_mb=t.spec.memory_mb if t.spec.memory_mb is not None else t.settings.memory_mb,
                labels=labels)
            t.env_id = env_id
            self.created += 1
            log.debug("tangram: trajectory %s -> environment %s", key, env_id)
            if t.spec.setup_command:
                r = await client.exec(env_id, t.spec.setup_command, cpu=1, timeout_s=t.settings.tool_timeout_s)
                t.setup_result = r
                self.record(key, "exec", "setup", r)
                if not r.ok:
                    log.warning("tangram: setup of %s failed (%s, exit %s): %s", env_id, r.status, r.exit_code,
                                (r.stderr or r.error or "")[-500:])
            return env_id

    async def release(self, key: str) -> bool:
        """Delete trajectory ``key``'s environment (if any) and forget it. Idempotent."""
        t = self._t.pop(key, None)
        if t is None or t.env_id is None:
            return False
        try:
            await get_client(t.settings).delete_environment(t.env_id)
        except TangramHTTPError as exc:
            if exc.status != 404:
                log.warning("tangram: could not delete environment %s of %s: %s", t.env_id, key, exc)
                return False
        self.released += 1
        return True

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
        return stale

    async def maybe_sweep(self) -> None:
        if time.monotonic() - self._last_sweep >= self._sweep_every_s:
            await self.sweep()


REGISTRY = TrajectoryRegistry()
