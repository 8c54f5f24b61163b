"""The ``trajectory`` of an http or model action: the order's generation credit sees the rollout an API
call belongs to, as the simulator's trajectories do, and the books of a trajectory with no environment
are bounded (tangram/runtime/loose.py)."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from tangram.core.errors import DemandError
from tangram.runtime.loose import LooseTrajectories
from tangram.service import wire
from tests.service_helpers import config, running_service

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def _upstream():
    """An API on loopback answering every GET; yields its URL."""
    async def ok(_):
        return web.json_response({"ok": True})

    upstream = web.Application()
    upstream.router.add_get("/", ok)
    runner = web.AppRunner(upstream)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
    finally:
        await runner.cleanup()


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


async def test_an_api_call_naming_a_trajectory_holds_no_memory_or_cores_of_its_own():
    """The engine keeps a trajectory's memory and node until the trajectory closes: a call that named one
    and held memory would keep it reserved long after it ended."""
    async with running_service(config(api_pools={"search": {"concurrency": 2}})) as svc:
        for resources in ({"api": "search", "mem_mb": 300}, {"api": "search", "cpu": 1}):
            with pytest.raises(DemandError) as err:
                svc.runtime.build_action("http", resources, payload={"url": "http://127.0.0.1:1/"}, trajectory="t")
            assert err.value.field == "trajectory"
        svc.runtime.build_action("http", {"api": "search", "mem_mb": 300}, payload={"url": "http://127.0.0.1:1/"})


async def test_the_generation_between_a_trajectorys_api_calls_is_credited():
    """Two calls of one trajectory 0.3 s apart: the engine counts the gap as its generation (what
    ``generation_credit`` weighs); a call without a trajectory is nobody's."""
    async with _upstream() as url:
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


def test_loose_trajectories_are_bounded_and_a_busy_one_is_kept():
    from tangram.core.generating import Generating
    from tangram.core.model import Action, Demand

    books = Generating()
    loose = LooseTrajectories(books, limit=2)

    def call(t: str, end: bool = True) -> Action:
        a = Action.build(f"{t}-{len(loose)}", {"api:search": Demand.fixed(1)}, trajectory=t)
        books.submitted(a, 0.0)
        loose.seen(t)
        if end:
            books.ended(a, None, 1.0)
        return a

    running = call("t0", end=False)  # t0 has an action in the engine
    call("t1")
    call("t2")
    assert books.done("t1") == 0 and books.done("t2") == 1 and books.busy("t0")  # t1 forgotten, t0 kept
    books.ended(running, None, 2.0)
    call("t2")
    call("t3")
    assert books.done("t0") == 0 and books.done("t2") == 2 and books.done("t3") == 1 and len(loose) == 2


def test_a_trajectory_closed_while_its_action_ran_keeps_no_books():
    """An environment deleted while an http call of its trajectory runs: the call's end writes nothing
    back for the closed trajectory (nothing would ever remove it)."""
    from tangram.core.generating import Generating
    from tangram.core.model import Action, Demand

    books = Generating()
    a = Action.build("a1", {"api:search": Demand.fixed(1)}, trajectory="env-1")
    books.submitted(a, 0.0)
    books.closed("env-1")
    assert books.ended(a, None, 1.0) is False
    assert (books.done("env-1"), books.generated_s("env-1", 5.0), books.busy("env-1")) == (0, 0.0, False)


async def test_a_rollout_named_before_its_environment_is_the_environments_once_made():
    """API calls named "k" before the rollout had an environment, then the environment created with
    "trajectory": "k": those calls' books move to it, and later calls naming "k" are the environment's."""
    async with _upstream() as url:
        async with running_service(config(api_pools={"search": {"concurrency": 2}})) as svc:
            rt = svc.runtime
            async with aiohttp.ClientSession() as s:
                body = {"kind": "http", "url": url, "method": "GET", "resources": {"api": "search"}, "trajectory": "k"}
                for _ in range(2):
                    assert (await s.post(f"{svc.url}/v1/actions", json=body)).status == 200
                r = await s.post(f"{svc.url}/v1/environments", json={"trajectory": "k"})
                assert r.status == 201
                env = (await r.json())["id"]
                books = rt.engine.generating
                assert (books.done(env), books.done("k"), len(rt.loose)) == (2, 0, 0)
                assert (await s.post(f"{svc.url}/v1/actions", json=body)).status == 200
                assert books.done(env) == 3 and rt.build_action("http", {"api": "search"}, payload={"url": url},
                                                                 trajectory="k").trajectory == env
                r = await s.post(f"{svc.url}/v1/environments", json={"trajectory": ""})
                assert r.status == 400 and (await r.json())["field"] == "trajectory"
                assert (await s.delete(f"{svc.url}/v1/environments/{env}")).status == 204
                assert books.done(env) == 0  # closed with it
