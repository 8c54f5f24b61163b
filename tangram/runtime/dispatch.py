"""From a started action to a running one: its placement and the executor of its kind.

``exec`` runs on the environment executor of its node, ``http`` on the HTTP
executor, ``model`` on its GPU node's model runner; every run is bounded by
the action's ``timeout_s`` (the executor's own job) plus a safety net.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Mapping

from tangram.core.engine import Started
from tangram.core.grants import cores_of, devices_of
from tangram.core.model import Action, render_command
from tangram.executors.base import EnvironmentExecutor, ExecResult, Placement, wait_through_cancels

log = logging.getLogger("tangram.runtime")

# the executor is trusted to honour timeout_s itself; past this much more (an environment executor's
# stop_grace_s: its kill takes longer) the runtime cancels it
TIMEOUT_GRACE_S = 2.0


class ExecutorTimedOut(Exception):
    """The safety net fired: the executor ignored ``timeout_s`` and was cancelled."""


class Dispatcher:
    """The executors of one runtime, chosen by action kind and node.

    ``env_executors`` maps each CPU node to the executor of its environments;
    ``model_executors`` maps each GPU node to an object with
    ``async run(action, placement, *, timeout_s) -> ExecResult`` (or is a
    single such object for every node); ``http_executor`` has
    ``async run(request, *, timeout_s) -> ExecResult``.
    """

    def __init__(self, env_executors: Mapping[str, EnvironmentExecutor], http_executor: Any,
                 model_executors: Mapping[str, Any] | Any):
        self.env_executors = env_executors
        self.http_executor = http_executor
        self.model_executors = model_executors

    def kinds(self) -> frozenset[str]:
        """The action kinds that have an executor."""
        have = {"exec"} if self.env_executors else set()
        if self.http_executor is not None:
            have.add("http")
        if self.model_executors is not None:
            have.add("model")
        return frozenset(have)

    async def run(self, action: Action, kind: str, env_id: str | None, placement: Placement) -> ExecResult:
        """Run ``action`` on its executor; raises ExecutorTimedOut when the safety net fires."""
        p = action.payload
        timeout_s = action.timeout_s
        grace_s = TIMEOUT_GRACE_S
        if kind == "exec":
            executor = self.env_executors[placement.node]
            extra = {"stdin": p["stdin"]} if p.get("stdin") is not None else {}  # only executors that take input
            coro = executor.exec(env_id, render_command(p["command"], placement.dop), placement,
                                 timeout_s=timeout_s, env={"TANGRAM_DOP": str(placement.dop), **p.get("env", {})},
                                 **extra)
            own = getattr(executor, "stop_grace_s", None)  # a Docker kill takes seconds
            grace_s = TIMEOUT_GRACE_S if own is None else float(own)
        elif kind == "http":
            req = {k: p[k] for k in ("url", "method", "headers", "json", "body") if k in p}
            coro = self.http_executor.run(req, timeout_s=timeout_s)
        elif kind == "model":
            coro = self.model_executor(placement.node).run(action, placement, timeout_s=timeout_s)
        else:
            raise RuntimeError(f"unknown action kind {kind!r}")
        if timeout_s is None:
            return await coro
        # safety net: an executor that ignores timeout_s is cancelled (and must kill) a bit later. Not
        # asyncio.wait_for: a second cancel (a DELETE after a hang-up) ends its wait for the executor's
        # kill, and the caller then gave the units back while the process still ran
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait((task,), timeout=timeout_s + grace_s)  # never cancels the task
        finally:
            if not task.done():  # the net fired, or this run is cancelled: the executor kills first
                task.cancel()
                cancelled = await wait_through_cancels(task)
                if not task.cancelled():
                    task.exception()  # retrieved here; the timeout's path below raises it again
                if cancelled:
                    raise asyncio.CancelledError()
        if task.cancelled():
            raise ExecutorTimedOut()
        return task.result()

    def model_executor(self, node: str | None) -> Any:
        ex = self.model_executors
        if isinstance(ex, Mapping):
            ex = ex.get(node)
        if ex is None:
            raise RuntimeError(f"node {node!r} has no GPU model executor")
        return ex

    def all(self) -> Iterable[Any]:
        """Every distinct executor (for closing)."""
        seen: dict[int, Any] = {id(e): e for e in self.env_executors.values()}
        if self.http_executor is not None:
            seen[id(self.http_executor)] = self.http_executor
        mex = self.model_executors
        for e in (mex.values() if isinstance(mex, Mapping) else [mex] if mex else []):
            seen[id(e)] = e
        return list(seen.values())

    async def close(self) -> None:
        for ex in self.all():
            await _maybe_close(ex)


def placement_of(s: Started) -> Placement:
    """The executor's view of a started action: its node, DoP, cores and GPU devices."""
    d = s.dispatch
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    for pname, grant in s.grants.items():
        if pname.startswith("cpu@"):
            cores = cores_of(grant)
        elif pname.startswith("gpu@"):
            gpus = devices_of(grant)
    return Placement(action_id=s.record.id, node=d.node, dop=d.dop, cores=cores, gpu_devices=gpus,
                     grants=dict(s.grants))


def allocation_of(placement: Placement | None, isolation: str | None, restarted_s: float = 0.0) -> dict[str, Any]:
    """The ``allocation`` object of a result: where it ran and on what; ``restarted_s``: the seconds of runs a
    restart stopped (its last run had that much less of ``timeout_s``)."""
    if placement is None:
        return {}
    alloc: dict[str, Any] = {"node": placement.node, "dop": placement.dop}
    if restarted_s > 0:
        alloc["restarted_s"] = round(restarted_s, 6)
    if placement.cores:
        alloc["cores"] = list(placement.cores)
    if placement.gpu_devices:
        alloc["gpus"] = list(placement.gpu_devices)
    apis = [p for p in placement.grants if p.startswith("api:")]
    if apis:
        alloc["api"] = apis[0][4:]
    if isolation is not None:
        alloc["isolation"] = isolation
    return alloc


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
