"""The ``trajectory`` of an http or model action: the order's generation credit sees the rollout an API
call belongs to, as the simulator's trajectories do, and the books of a trajectory with no environment
are bounded (tangram/runtime/loose.py)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from tangram.core.errors import DemandError
from tangram.runtime.loose import LooseTrajectories
from tangram.service import wire
from tests.service_helpers import config, running_service

pytestmark = pytest.mark.timeout(60)


def test_the_wire_takes_a_trajectory_on_http_and_model_actions_and_names_it_when_malformed():
    http = {"kind": "http", "url": "http://127.0.0.1:1/", "trajectory": "traj-1"}
    assert wire.parse_action(http)["trajectory"] == "traj-1"
    model = {"kind": "model", "model": "m", "inputs": ["x"], "trajectory": "traj-1"}
    assert wire.parse_action(model)["trajectory"] == "traj-1"
    for bad in (7, "", "x" * 300, ["t"]):
        with pytest.raises(DemandError) as err:
            wire.parse_action({**http, "trajectory": bad})
        assert err.value.field == "trajectory"
    with pytest.raises(DemandError) as err:  # an exec action's trajectory is its environment
        wire.parse_action({"kind": "exec", "command": "true", "environment": "e", "trajectory": "e"})
    assert err.value.field == "trajectory"


async def test_an_exec_actions_trajectory_is_its_environment():
    async with running_service(config()) as svc:
        rt = svc.runtime
        env = await rt.create_environment()
        a = rt.build_action("exec", {"cpu": 1}, environment=env, command="true", trajectory=env)
        assert a.trajectory == env
        with pytest.raises(DemandError) as err:
            rt.build_action("exec", {"cpu": 1}, environment=env, command="true", trajectory="other")
        assert err.value.field == "trajectory"
        await rt.delete_environment(env)


async def test_the_generation_between_a_trajectorys_api_calls_is_credited():
    """Two calls of one trajectory 0.3 s apart: the engine counts the gap as its generation (what
    ``generation_credit`` weighs); a call without a trajectory is nobody's."""
    async def ok(_):
        return web.json_response({"ok": True})

    upstream = web.Application()
    upstream.router.add_get("/", ok)
    runner = web.AppRunner(upstream)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
    try:
        async with running_service(config(api_pools={"search": {"concurrency": 2}})) as svc:
            async with aiohttp.ClientSession() as s:
                body = {"kind": "http", "url": url, "method": "GET", "resources": {"api": "search"}}
                for _ in range(2):
                    r = await s.post(f"{svc.url}/v1/actions", json={**body, "trajectory": "traj-a"})
                    assert (r.status, (await r.json())["status"]) == (200, "succeeded")
                    await asyncio.sleep(0.3)
                r = await s.post(f"{svc.url}/v1/actions", json=body)
                assert r.status == 200
            books = svc.runtime.engine._generating
            assert books.done("traj-a") == 2
            assert books.generated_s("traj-a", svc.runtime.clock()) >= 0.5  # the gap and the quiet since
            assert len(svc.runtime.loose) == 1
    finally:
        await runner.cleanup()


def test_loose_trajectories_are_bounded_and_a_busy_one_is_kept():
    closed: list[str] = []
    busy = {"t0"}
    books = LooseTrajectories(closed.append, busy.__contains__, limit=2)
    for t in ("t0", "t1", "t2"):
        books.seen(t)
    assert closed == ["t1"] and len(books) == 2  # t0, the oldest, has an action in the engine: kept
    books.seen("t2")  # named again: the most recent
    busy.clear()
    books.seen("t3")
    assert closed == ["t1", "t0"]
    books.seen("t4")
    assert closed == ["t1", "t0", "t2"] and len(books) == 2
