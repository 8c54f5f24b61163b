"""``http`` actions through API pools (concurrency, quota refills) and ``model`` actions on (virtual) GPUs."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from tangram.client import TangramHTTPError
from tests.service_helpers import assert_whole, config, running_service

pytestmark = pytest.mark.timeout(120)


class _Target:
    """An API on loopback that records how many calls it serves at once."""

    def __init__(self):
        self.in_flight = 0
        self.peak = 0
        self.calls: list[float] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.calls.append(time.monotonic())
        try:
            await asyncio.sleep(float(request.query.get("sleep", "0.05")))
            body = await request.json() if request.can_read_body else None
            return web.json_response({"echo": body})
        finally:
            self.in_flight -= 1


@pytest.fixture
async def target():
    t = _Target()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", t.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    t.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield t
    await runner.cleanup()


async def test_http_actions_respect_concurrency(target):
    cfg = config(api_pools={"search": {"concurrency": 2}})
    async with running_service(cfg) as svc, svc.client() as c:
        body = {"kind": "http", "url": f"{target.url}/q?sleep=0.1", "method": "POST", "json": {"q": 1},
                "resources": {"api": "search"}}
        results = await asyncio.gather(*(c.run_action(body) for _ in range(8)))
        assert all(r.ok for r in results), results[0]
        assert results[0].output["body"] == {"echo": {"q": 1}} and results[0].allocation["api"] == "search"
        assert target.peak == 2  # the service did the traffic control
        failed = await c.run_action({"kind": "http", "url": "http://127.0.0.1:1/", "resources": {"api": "search"}})
        assert failed.status == "failed" and failed.error
        with pytest.raises(TangramHTTPError) as e:
            await c.run_action({"kind": "http", "url": target.url, "resources": {"api": "nope"}})
        assert (e.value.status, e.value.field) == (422, "resources.api")
        assert_whole(svc.runtime)


async def test_quota_refill_wakes_the_queue(target):
    cfg = config(api_pools={"paid": {"quota": 2, "period_s": 0.4, "window": "fixed"}})
    async with running_service(cfg) as svc, svc.client() as c:
        body = {"kind": "http", "url": f"{target.url}/?sleep=0", "resources": {"api": "paid"}}
        t0 = time.monotonic()
        results = await asyncio.gather(*(c.run_action(body) for _ in range(6)))
        assert all(r.ok for r in results)
        assert time.monotonic() - t0 >= 0.6  # 2 per window: three windows
        assert max(r.timing.queued_s for r in results) >= 0.3
        assert_whole(svc.runtime)


def make_scorer():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
async def test_model_actions_on_gpus(device):
    pytest.importorskip("torch")
    gpus = 2
    if device == "cuda":
        if _cuda_devices() < 1:
            pytest.skip("no CUDA device")
        gpus = 2 if _cuda_devices() >= 2 else 1
    cfg = config(gpu_nodes=[{"name": "g0", "gpus": gpus, "device": device, "memory_mb_per_gpu": 1024,
                             "services": [{"name": "scorer", "options": {"factory": "tests.test_service_kinds:make_scorer"}}]}])
    async with running_service(cfg) as svc, svc.client() as c:
        body = {"kind": "model", "model": "scorer", "op": "score", "inputs": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.5]]}
        r1 = await c.run_action(body)
        assert r1.ok, r1.error
        assert len(r1.output) == 2 and r1.allocation["gpus"] in ([0], [1])
        r2 = await c.run_action({**body, "resources": {"gpu": gpus}})
        assert r2.ok and r2.allocation["gpus"] == list(range(gpus))
        assert r2.output == pytest.approx(r1.output, rel=1e-4)
        with pytest.raises(TangramHTTPError) as e:
            await c.run_action({**body, "model": "unknown"})
        assert (e.value.status, e.value.field) == (400, "model")
        with pytest.raises(TangramHTTPError) as e:
            await c.run_action({**body, "resources": {"gpu": 4}})
        assert e.value.status == 422
        with pytest.raises(TangramHTTPError) as e:
            await c.run_action({**body, "op": "dance"})
        assert (e.value.status, e.value.field) == (400, "op")
        assert_whole(svc.runtime)
