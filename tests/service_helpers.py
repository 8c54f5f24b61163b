"""A real service on loopback with a real client, and the "every pool is whole" check."""
from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any, AsyncIterator

from tangram.client import TangramClient
from tangram.runtime import Runtime
from tangram.service import launch
from tangram.service.app import RUNTIME_KEY, create_app, start_site
from tangram.service.config import parse_config
from tangram.service.launch import ServeProcess

N_CORES = len(os.sched_getaffinity(0))
FORK_BOMB = ("import os, time\n"
             "n = 0\n"
             "while n < 5000:\n"
             "    try:\n"
             "        pid = os.fork()\n"
             "    except OSError:\n"
             "        break\n"
             "    if pid == 0:\n"
             "        time.sleep(3600)\n"
             "        os._exit(0)\n"
             "    n += 1\n"
             "print(n, flush=True)\n")  # forks until the pids limit stops it; prints how many it made


def config(**overrides: Any):
    doc: dict[str, Any] = {
        "cpu_nodes": [{"name": "local", "executor": "local", "cores": N_CORES, "memory_mb": 4096}],
        "gpu_nodes": [],
    }
    doc.update(overrides)
    return parse_config(doc)


class Service:
    def __init__(self, app, runner, port: int):
        self.app = app
        self.runner = runner
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    @property
    def runtime(self) -> Runtime:
        return self.app[RUNTIME_KEY]

    def client(self, **kw: Any) -> TangramClient:
        return TangramClient(self.url, **kw)


@contextlib.asynccontextmanager
async def running_service(cfg=None, **kw: Any) -> AsyncIterator[Service]:
    app = create_app(cfg or config(), **kw)
    runner, port = await start_site(app, "127.0.0.1", 0)
    try:
        yield Service(app, runner, port)
    finally:
        await runner.cleanup()


async def until(pred, timeout_s: float = 3.0) -> None:
    """Wait until ``pred()`` holds, polling every 10 ms; fail after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def settle(rt: Runtime, timeout_s: float = 5.0) -> None:
    """Wait until nothing runs or waits (a cancelled action's kill takes a moment)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while rt.engine.running or rt.engine.waiting:
        if loop.time() > deadline:
            raise AssertionError(f"still running {sorted(rt.engine.running)}, waiting {sorted(rt.engine.waiting)}")
        await asyncio.sleep(0.01)


def assert_whole(rt: Runtime, *, live_envs_mem: int = 0) -> None:
    """The engine's books balance and every pool has all its units back.

    ``mem@`` pools keep the reservations of live environments (``live_envs_mem``
    MiB in all); API pools with a quota keep consumed quota until their window passes.
    """
    rt.check_whole()
    for name, p in rt.engine.pool_states().items():
        if p.rtype == "mem":
            assert p.free == p.capacity - live_envs_mem, f"{name}: free {p.free} of {p.capacity}"
        elif p.rtype.startswith("api:"):
            continue
        else:
            assert p.free == p.capacity, f"{name}: free {p.free} of {p.capacity}"
    for m in rt.engine.managers:
        for pool, holders in m.held().items():
            if not pool.startswith("mem@"):
                assert not holders, f"{pool} still held by {holders}"


def find_pids(marker: str, *, exact: bool = False) -> list[int]:
    """Live processes whose command line, its arguments joined by spaces, contains ``marker``
    (``sleep 61.2`` finds the ``sleep`` itself, whose arguments /proc separates by NULs);
    ``exact``: is ``marker``. A process on its way to the marked one (``sh -c 'exec sleep 61.2'``)
    contains it too, but not while it execs: /proc then shows an empty command line for a moment."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if (cmd.strip() == marker.encode()) if exact else (marker.encode() in cmd):
            out.append(int(d))
    return out


REPO = Path(__file__).resolve().parent.parent


def start_serve(args: list[str], *, wait_s: float = 60.0) -> ServeProcess:
    """``tangram serve ARGS`` as a subprocess of this checkout, once it listens (``.url``, ``.stop()``)."""
    return launch.start_serve(args, wait_s=wait_s, cwd=REPO)


@contextlib.asynccontextmanager
async def local_app(routes: list[tuple[str, str, Any]]) -> AsyncIterator[str]:
    """A bare aiohttp app on a free loopback port serving ``(method, path, handler)`` routes: its URL
    (a test's stand-in for an upstream or a misbehaving service), removed on exit."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
