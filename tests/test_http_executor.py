"""HTTP executor and basic manager against a real local aiohttp server that
enforces its own limits (max 3 concurrent, 10 per 0.5 s sliding window of
arrivals) and answers 429 beyond them. A naive burst sees 429s; the same
calls driven through the engine with the basic manager see none."""
from __future__ import annotations

import asyncio
import collections
import time

import pytest
from aiohttp import web

from tangram.core.engine import Engine, Started
from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT
from tangram.executors.http import HttpExecutor
from tangram.managers.basic import BasicManager
from tests.test_basic_manager import api_action, drive

pytestmark = pytest.mark.timeout(60)

MAX_CONCURRENT, QUOTA, PERIOD = 3, 10, 0.5


class LimitedServer:
    """Counts what it accepted and what it refused with 429."""

    def __init__(self):
        self.in_flight = 0
        self.arrivals: collections.deque[float] = collections.deque()
        self.ok = 0
        self.refused = 0
        self.max_seen = 0

    async def handle(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        while self.arrivals and self.arrivals[0] <= now - PERIOD:
            self.arrivals.popleft()
        if self.in_flight >= MAX_CONCURRENT or len(self.arrivals) >= QUOTA:
            self.refused += 1
            return web.json_response({"error": "rate limited"}, status=429)
        self.arrivals.append(now)
        self.in_flight += 1
        self.max_seen = max(self.max_seen, self.in_flight)
        try:
            await asyncio.sleep(float(request.query.get("sleep", "0.03")))
        finally:
            self.in_flight -= 1
        self.ok += 1
        body = await request.json() if request.can_read_body else None
        return web.json_response({"echo": body, "n": self.ok})

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("sleep", "5")))
        return web.Response(text="slow")

    async def text(self, request: web.Request) -> web.Response:
        return web.Response(text="plain", status=int(request.query.get("status", "200")))

    async def limited(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "slow down"}, status=429, headers={
            "Retry-After": "2", "X-RateLimit-Remaining": "0", "RateLimit-Reset": "1.5", "X-Other": "x"})


@pytest.fixture
async def server():
    state = LimitedServer()
    app = web.Application()
    app.router.add_route("*", "/call", state.handle)
    app.router.add_get("/text", state.text)
    app.router.add_get("/limited", state.limited)
    app.router.add_get("/slow", state.slow)
    runner = web.AppRunner(app, shutdown_timeout=0.2)  # do not wait for /slow handlers
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


async def test_http_executor_reports_status_body_latency(server):
    async with HttpExecutor() as ex:
        r = await ex.call(f"{server.url}/call", method="POST", json={"q": 1})
        assert r.status == SUCCEEDED
        assert r.output["status"] == 200
        assert r.output["body"] == {"echo": {"q": 1}, "n": 1}
        assert r.output["latency_s"] >= 0.03
        r = await ex.call(f"{server.url}/text?status=503")
        assert (r.status, r.output["status"], r.output["body"], r.error) == (FAILED, 503, "plain", "HTTP 503")
        r = await ex.run({"url": f"{server.url}/call?sleep=2"}, timeout_s=0.1)
        assert r.status == TIMEOUT and r.output["status"] is None
        r = await ex.call("http://127.0.0.1:1/nothing-listens")
        assert r.status == FAILED and "Client" in r.error
    await ex.close()  # idempotent


async def test_rate_limit_headers_come_back_in_details(server):
    async with HttpExecutor() as ex:
        r = await ex.call(f"{server.url}/limited")
        assert (r.status, r.output["status"], r.error) == (FAILED, 429, "HTTP 429")
        # only what the basic manager reads: Retry-After and the rate-limit family
        assert r.rate_headers == {"Retry-After": "2", "X-RateLimit-Remaining": "0", "RateLimit-Reset": "1.5"}
        r = await ex.call(f"{server.url}/text")
        assert r.rate_headers is None


@pytest.mark.parametrize("kwargs, field", [
    ({"url": "ftp://x"}, "url"),
    ({"url": "http://x", "method": "BREW"}, "method"),
    ({"url": "http://x", "json": {}, "body": "b"}, "body"),
    ({"url": "http://x", "timeout_s": 0}, "timeout_s"),
])
async def test_http_bad_input_names_field(kwargs, field):
    async with HttpExecutor() as ex:
        with pytest.raises(ValueError, match=f"^{field}:"):
            await ex.call(**kwargs)


async def test_naive_burst_sees_429(server):
    async with HttpExecutor() as ex:
        results = await asyncio.gather(*(ex.call(f"{server.url}/call") for _ in range(30)))
    codes = collections.Counter(r.output["status"] for r in results)
    assert codes[429] > 0, codes
    assert server.refused == codes[429]


async def test_engine_with_basic_manager_never_sees_429(server):
    # the manager's window is a little longer than the server's: request arrival jitter
    manager = BasicManager({"svc": {"concurrency": MAX_CONCURRENT, "quota": QUOTA, "period_s": PERIOD * 1.1}})
    engine = Engine([manager])
    codes: collections.Counter = collections.Counter()
    n = 30
    async with HttpExecutor() as ex:
        async def run(s: Started) -> str:
            r = await ex.run(s.action.payload)
            codes[r.output["status"]] += 1
            return r.status

        t0 = time.monotonic()
        actions = [api_action(i, url=f"{server.url}/call", method="POST", json={"i": i}) for i in range(n)]
        statuses = await drive(engine, actions, run, deadline_s=30)
        elapsed = time.monotonic() - t0
    assert codes == {200: n}, codes
    assert server.refused == 0 and server.ok == n
    assert set(statuses.values()) == {"succeeded"}
    assert server.max_seen <= MAX_CONCURRENT
    # 30 calls at 10 per 0.55 s need at least two refills
    assert elapsed >= 2 * PERIOD * 1.1
    engine.check_invariants()
    assert manager.held() == {"api:svc": {}}
    assert engine.pool_states()["api:svc"].free <= MAX_CONCURRENT


async def test_engine_releases_api_slots_after_errors_and_cancel(server):
    manager = BasicManager({"svc": {"concurrency": 2}})
    engine = Engine([manager])
    async with HttpExecutor() as ex:
        async def run(s: Started) -> str:
            i = int(s.action.id[1:])
            if i % 3 == 0:
                raise RuntimeError("executor crashed")
            if i % 3 == 1:
                return (await ex.run({"url": f"{server.url}/slow?sleep=1"}, timeout_s=0.05)).status
            return (await ex.run({"url": f"{server.url}/text?status=500"})).status

        async def safe(s: Started) -> str:
            try:
                return await run(s)
            except RuntimeError:
                return "failed"

        statuses = await drive(engine, [api_action(i) for i in range(9)], safe)
        assert collections.Counter(statuses.values()) == {"failed": 6, "timeout": 3}
        # cancel a running call: the driver kills it and reports cancel
        started = engine.submit(api_action(100))
        task = asyncio.ensure_future(ex.run({"url": f"{server.url}/slow?sleep=5"}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.cancel(started[0].action.id)
    engine.check_invariants()
    assert manager.held() == {"api:svc": {}}
    assert engine.pool_states()["api:svc"].free == 2
