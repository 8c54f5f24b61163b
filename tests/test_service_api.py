"""The wire API against a real service on loopback, the real client and the real local executor.

After each scenario every pool must be whole again: no core, memory
reservation or API slot may outlive an error, a timeout or a cancellation.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import uuid

import aiohttp
import pytest

from tangram.client import TangramHTTPError
from tests.service_helpers import N_CORES, assert_whole, config, find_pids, running_service, settle

pytestmark = pytest.mark.timeout(120)


async def test_exec_in_environment_keeps_files_and_reserves_memory():
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        env = await c.create_environment(memory_mb=512, labels={"task": "t1"})
        r1 = await c.exec(env, "echo hello > f.txt && echo dop=$TANGRAM_DOP")
        assert r1.ok and r1.exit_code == 0 and r1.stdout == "dop=1\n"
        assert r1.allocation["node"] == "local" and len(r1.allocation["cores"]) == 1
        assert r1.timing.exec_s > 0 and r1.timing.overhead_s >= 0 and r1.timing.queued_s >= 0
        r2 = await c.exec(env, "cat f.txt")
        assert r2.stdout == "hello\n"
        # the trajectory's memory stays reserved between its actions
        assert rt.engine.pool_states()["mem@local"].free == 4096 - 512
        assert_whole(rt, live_envs_mem=512)
        await c.delete_environment(env)
        assert_whole(rt)
        with pytest.raises(TangramHTTPError) as e:
            await c.delete_environment(env)
        assert e.value.status == 404


async def test_one_shot_exec_leaves_no_environment():
    async with running_service() as svc, svc.client() as c:
        r = await c.exec(None, "pwd; exit 3")
        assert r.status == "failed" and r.exit_code == 3
        assert not os.path.exists(r.stdout.strip())
        assert svc.runtime.environments() == []
        assert_whole(svc.runtime)


async def test_profile_makes_the_action_elastic(tmp_path):
    store = tmp_path / "profiles.json"
    store.write_text(json.dumps({"version": 1, "classes": {
        "suite": {"t1_s": 4.0, "efficiency": {"1": 1.0, str(N_CORES): 1.0}, "samples": 5}}}))
    async with running_service(config(profiles=[str(store)])) as svc, svc.client() as c:
        r = await c.exec(None, "echo ${parallel_num} $TANGRAM_DOP", cpu={"min": 1, "max": N_CORES}, profile="suite")
        assert r.ok and r.stdout.split() == [str(N_CORES)] * 2
        assert r.allocation["dop"] == N_CORES and len(r.allocation["cores"]) == N_CORES
        with pytest.raises(TangramHTTPError) as e:
            await c.exec(None, "true", profile="nope")
        assert (e.value.status, e.value.field) == (400, "profile")
        assert_whole(svc.runtime)


async def test_timeout_kills_the_process():
    async with running_service() as svc, svc.client() as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await c.exec(None, "sleep 30", timeout_s=0.3)
        assert r.status == "timeout"
        assert loop.time() - t0 < 5
        assert_whole(svc.runtime)


async def test_submit_poll_and_cancel_running_and_queued():
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        body = {"kind": "exec", "command": "sleep 30", "resources": {"cpu": N_CORES}}
        running = await c.submit(body)
        queued = await c.submit(body)  # waits: every core is taken
        await asyncio.sleep(0.2)
        assert (await c.get_action(running)).status == "running"
        assert (await c.get_action(queued)).status == "waiting"
        s = await c.stats()
        assert s["queue_length"] == 1 and s["pools"]["cpu@local"]["queue_length"] == 1
        assert s["pools"]["cpu@local"]["utilisation"] == 1.0
        rq = await c.cancel(queued)
        assert rq.status == "cancelled"
        rr = await c.cancel(running)
        assert rr.status == "cancelled" and rr.timing.exec_s > 0
        assert (await c.get_action(running)).status == "cancelled"
        await settle(rt)
        assert_whole(rt)
        with pytest.raises(TangramHTTPError) as e:
            await c.get_action("no-such-action")
        assert e.value.status == 404


async def test_client_disconnect_cancels_the_action():
    async with running_service() as svc:
        rt = svc.runtime
        marker = f"sleep 30.{uuid.uuid4().int % 10**6}"
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": marker}))
            for _ in range(200):
                if rt.engine.running:
                    break
                await asyncio.sleep(0.01)
            assert rt.engine.running
            req.cancel()  # drops the connection
            with pytest.raises(asyncio.CancelledError):
                await req
        await settle(rt, timeout_s=5)
        assert_whole(rt)
        assert rt.counts.get(("exec", "cancelled")) == 1
        await asyncio.sleep(0.1)
        assert not [p for p in find_pids(marker) if p != os.getpid()]


async def test_an_action_sent_under_a_key_outlives_its_client_and_the_resubmission_collects_it():
    """A client that loses its connection while its action runs (a proxy's reset) sends it again under
    the same Idempotency-Key: the action (with a timeout_s, which bounds it) was not cancelled, ran once,
    and the resubmission answers its result. Without a key, or a timeout, the disconnect cancels it."""
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment()
        body = {"kind": "exec", "environment": env, "command": "sleep 0.6; echo x >> n; wc -l < n", "timeout_s": 30}
        headers = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"{svc.url}/v1/actions", json=body, headers=headers))
            for _ in range(200):
                if svc.runtime.engine.running:
                    break
                await asyncio.sleep(0.01)
            assert svc.runtime.engine.running
            req.cancel()  # drops the connection
            with pytest.raises(asyncio.CancelledError):
                await req
        await asyncio.sleep(0.4)  # past the disconnect watcher's look
        assert svc.runtime.engine.running  # not cancelled
        async with aiohttp.ClientSession() as s, s.post(f"{svc.url}/v1/actions", json=body, headers=headers) as r:
            out = await r.json()
        assert (r.status, out["status"], out["stdout"]) == (200, "succeeded", "1\n"), out
        await c.delete_environment(env)
        assert_whole(svc.runtime)


async def test_client_disconnect_while_queued_cancels_the_action():
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        blocker = await c.submit({"kind": "exec", "command": "sleep 30", "resources": {"cpu": N_CORES}})
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "true"}))
            for _ in range(200):
                if rt.engine.waiting:
                    break
                await asyncio.sleep(0.01)
            assert len(rt.engine.waiting) == 1
            req.cancel()
            with pytest.raises(asyncio.CancelledError):
                await req
        for _ in range(200):
            if not rt.engine.waiting:
                break
            await asyncio.sleep(0.01)
        assert not rt.engine.waiting and rt.counts.get(("exec", "cancelled")) == 1
        await c.cancel(blocker)
        await settle(rt)
        assert_whole(rt)


async def test_a_client_gone_as_the_gate_hands_its_action_over_cancels_it(monkeypatch):
    """The handler's cancellation (its client went) can land just as the admission gate hands the
    action to the engine: no longer held, so not cancelled there, it must be cancelled in the
    runtime (else it ran to its end for nobody: the cleanup test's hung-up client once saw it)."""
    from tangram.service.keys import GATE_KEY

    async with running_service() as svc:
        rt, gate = svc.runtime, svc.app[GATE_KEY]
        marker = f"sleep 30.{uuid.uuid4().int % 10**6}"
        handed_over = gate.submitted

        async def submitted_as_the_client_goes(action_id):
            await handed_over(action_id)  # the engine has it now
            raise asyncio.CancelledError  # and the client's cancellation lands at this await

        monkeypatch.setattr(gate, "submitted", submitted_as_the_client_goes)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": marker}) as r:
                    await r.read()
        await settle(rt, timeout_s=5)
        assert_whole(rt)
        assert rt.counts.get(("exec", "cancelled")) == 1
        await asyncio.sleep(0.1)
        assert not [p for p in find_pids(marker) if p != os.getpid()]


async def test_environment_creation_failure_is_a_502(monkeypatch):
    async with running_service() as svc, svc.client() as c:
        async def broken(*a, **kw):
            raise OSError("disk full")

        monkeypatch.setattr(svc.runtime.env_executors["local"], "create_environment", broken)
        with pytest.raises(TangramHTTPError) as e:
            await c.create_environment()
        assert e.value.status == 502 and "disk full" in e.value.message
        assert svc.runtime.environments() == []
        r = await c.exec(None, "true")  # a one-shot environment fails the action, not the service
        assert r.status == "failed" and "disk full" in r.error
        assert_whole(svc.runtime)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


async def test_killed_process_is_a_failed_action_and_leaks_nothing():
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        env = await c.create_environment(memory_mb=64)
        marker = f"sleep 31.{uuid.uuid4().int % 10**6}"
        task = asyncio.create_task(c.exec(env, f"{marker}; echo never"))
        pids: list[int] = []
        for _ in range(300):
            # the command's own processes: not bwrap, the sandbox outside them (its command line holds the
            # marker too), which reports the command's end
            pids = [p for p in find_pids(marker) if _comm(p) != "bwrap"]
            if any(_comm(p) == "sleep" for p in pids):  # the shell and its sleep: the command runs
                break
            await asyncio.sleep(0.01)
        assert pids, "the action's process never appeared"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        r = await asyncio.wait_for(task, 10)
        assert r.status == "failed" and r.exit_code not in (0, None), r
        assert "never" not in (r.stdout or "")
        assert_whole(rt, live_envs_mem=64)
        # the environment survives one killed action
        assert (await c.exec(env, "echo ok")).stdout == "ok\n"
        if rt.env_executors["local"].sandbox == "sandbox":
            # bwrap itself killed from outside (not by the command: it cannot signal it): the command's end
            # was never reported, so no exit code, no verdict on it
            marker = f"sleep 32.{uuid.uuid4().int % 10**6}"
            task = asyncio.create_task(c.exec(env, f"{marker}; echo never"))
            for _ in range(300):
                found = find_pids(marker)
                if any(_comm(p) == "sleep" for p in found):
                    pids = [p for p in found if _comm(p) == "bwrap"]
                    break
                await asyncio.sleep(0.01)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            r = await asyncio.wait_for(task, 10)
            assert r.status == "failed" and r.exit_code is None and "bwrap was killed (signal 9)" in r.error, r
            assert_whole(rt, live_envs_mem=64)
        await c.delete_environment(env)
        assert_whole(rt)


async def test_executor_crash_is_a_failed_action(monkeypatch):
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        ex = rt.env_executors["local"]

        async def boom(*a, **kw):
            raise RuntimeError("executor exploded")

        monkeypatch.setattr(ex, "exec", boom)
        r = await c.exec(None, "true")
        assert r.status == "failed" and "executor exploded" in r.error
        assert_whole(rt)
        monkeypatch.undo()
        assert (await c.exec(None, "true")).ok


async def test_many_concurrent_actions_all_complete():
    async with running_service() as svc, svc.client() as c:
        results = await asyncio.gather(*(c.exec(None, "true") for _ in range(300)))
        assert [r.status for r in results] == ["succeeded"] * 300
        assert len({r.id for r in results}) == 300
        assert_whole(svc.runtime)
        s = await c.stats()
        assert s["classes"]["exec"]["count"] == 300 and s["classes"]["exec"]["act_p99_s"] > 0
        assert s["actions"]["exec:succeeded"] == 300


async def test_delete_environment_cancels_its_running_action():
    async with running_service() as svc, svc.client() as c:
        env = await c.create_environment(memory_mb=100)
        aid = await c.submit({"kind": "exec", "environment": env, "command": "sleep 30"})
        await asyncio.sleep(0.2)
        await c.delete_environment(env)
        assert (await c.get_action(aid)).status == "cancelled"
        assert_whole(svc.runtime)


async def test_metrics_and_health():
    async with running_service() as svc, svc.client() as c:
        await c.exec(None, "true")
        assert (await c.health())["status"] == "ok"
        async with aiohttp.ClientSession() as s, s.get(f"{svc.url}/metrics") as resp:
            text = await resp.text()
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        assert 'tangram_actions_total{kind="exec",status="succeeded"} 1.0' in text
        assert 'tangram_pool_capacity{pool="cpu@local",type="cpu"}' in text
        assert "tangram_action_overhead_seconds_bucket" in text


async def test_auth_token_guards_every_route_but_healthz():
    async with running_service(config(service={"token": "s3cret"})) as svc:
        async with svc.client() as anon:
            assert (await anon.health())["status"] == "ok"
            for call in (anon.stats(), anon.create_environment(), anon.exec(None, "true")):
                with pytest.raises(TangramHTTPError) as e:
                    await call
                assert e.value.status == 401
        async with svc.client(token="wrong") as bad:
            with pytest.raises(TangramHTTPError) as e:
                await bad.stats()
            assert e.value.status == 401
        async with svc.client(token="s3cret") as good:
            assert (await good.exec(None, "true")).ok
        async with aiohttp.ClientSession() as s, s.get(f"{svc.url}/metrics") as resp:
            assert resp.status == 401
        assert_whole(svc.runtime)


# One intent per row: (body, expected status, expected field).
BAD_ACTIONS = [
    ("{not json", 400, "body"),  # malformed JSON
    ("[1, 2]", 400, "body"),  # not an object
    ({"command": "true"}, 400, "kind"),  # missing kind
    ({"kind": "teleport", "command": "true"}, 400, "kind"),  # unknown kind
    ({"kind": "exec"}, 400, "command"),  # missing field
    ({"kind": "exec", "command": 42}, 400, "command"),  # wrong type
    ({"kind": "exec", "command": "true", "resources": {"cpu": "two"}}, 400, "resources.cpu"),
    ({"kind": "exec", "command": "true", "resources": {"cpu": {"min": 0, "max": 2}}}, 400, "resources.cpu.min"),
    ({"kind": "exec", "command": "true", "resources": {"cpu": {"min": 3, "max": 2}}}, 400, "resources.cpu.max"),
    ({"kind": "exec", "command": "true", "resources": {"disk": 1}}, 400, "resources.disk"),
    ({"kind": "exec", "command": "true", "resources": []}, 400, "resources"),
    ({"kind": "exec", "command": "true", "timeout_s": -1}, 400, "timeout_s"),
    ({"kind": "exec", "command": "true", "timeout_s": "soon"}, 400, "timeout_s"),
    ({"kind": "exec", "command": "true", "timeout_s": 10**400}, 400, "timeout_s"),  # past a float (was a 500)
    ({"kind": "http", "url": "http://x", "method": "FOO", "resources": {"api": "s"}}, 400, "method"),
    ({"kind": "http", "url": "http://x", "headers": {"a b": "c"}, "resources": {"api": "s"}}, 400, "headers.a b"),
    ({"kind": "exec", "command": "true", "url": "http://x"}, 400, "url"),  # a field of another kind
    ({"kind": "exec", "command": "true", "bogus": 1}, 400, "bogus"),  # unknown field
    ({"kind": "exec", "command": "true", "resources": {"gpu": 1}}, 400, "resources.gpu"),
    ({"kind": "http", "url": "http://127.0.0.1:1/"}, 400, "resources.api"),  # no API pool configured
    ({"kind": "http", "url": "ftp://x", "resources": {"api": "s"}}, 400, "url"),
    ({"kind": "model", "model": "rm", "inputs": [1]}, 422, "kind"),  # no GPU executor here
    ({"kind": "model", "model": "rm", "inputs": [1], "resources": {"gpu": 3}}, 400, "resources.gpu"),
    ({"kind": "exec", "command": "true", "resources": {"cpu": 10_000}}, 422, "resources.cpu"),  # can never fit
    ({"kind": "exec", "command": "true", "resources": {"cpu": 1, "mem_mb": 10**9}}, 422, "resources.mem_mb"),
    ({"kind": "exec", "command": "true", "profile": "unknown"}, 400, "profile"),
    ({"kind": "exec", "command": "true", "environment": "env-nope"}, 404, None),  # unknown environment
]


@pytest.mark.parametrize("body,status,field", BAD_ACTIONS)
async def test_bad_actions_are_rejected_with_the_field(body, status, field):
    async with running_service() as svc, aiohttp.ClientSession() as s:
        data = body if isinstance(body, str) else json.dumps(body)
        async with s.post(f"{svc.url}/v1/actions", data=data,
                          headers={"Content-Type": "application/json"}) as resp:
            out = await resp.json()
        assert resp.status == status, out
        assert "error" in out
        if field is not None:
            assert out.get("field") == field, out
        assert not svc.runtime.engine.waiting and not svc.runtime.engine.running  # never queued
        assert_whole(svc.runtime)


BAD_ENVS = [
    ({"memory_mb": -5}, 400, "memory_mb"),
    ({"memory_mb": "lots"}, 400, "memory_mb"),
    ({"image": 3}, 400, "image"),
    ({"labels": {"a": 1}}, 400, "labels.a"),
    ({"colour": "red"}, 400, "colour"),
    ({"memory_mb": 10**9}, 422, "memory_mb"),  # no node has that much
]


@pytest.mark.parametrize("body,status,field", BAD_ENVS)
async def test_bad_environments_are_rejected(body, status, field):
    async with running_service() as svc, aiohttp.ClientSession() as s:
        async with s.post(f"{svc.url}/v1/environments", json=body) as resp:
            out = await resp.json()
        assert (resp.status, out.get("field")) == (status, field), out
        assert svc.runtime.environments() == []


async def test_body_too_large_and_unknown_routes():
    async with running_service(config(service={"max_body_bytes": 4096})) as svc, aiohttp.ClientSession() as s:
        big = {"kind": "exec", "command": "echo " + "x" * 10_000}
        async with s.post(f"{svc.url}/v1/actions", json=big) as resp:
            assert resp.status == 413
            out = await resp.json()  # the limit and the setting that raises it
            assert out["field"] == "body" and "at most 4096 bytes (service.max_body_bytes)" in out["error"], out

        async def chunks():  # no declared length: aiohttp's own limit on the read
            for _ in range(4):
                yield b'{"kind": "exec", "command": "' + b"x" * 2000

        async with s.post(f"{svc.url}/v1/actions", data=chunks()) as resp:
            out = await resp.json()
            assert resp.status == 413 and "at most 4096 bytes (service.max_body_bytes)" in out["error"], out
        async with s.get(f"{svc.url}/v1/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        async with s.delete(f"{svc.url}/v1/actions/nope") as resp:
            assert resp.status == 404
        async with s.post(f"{svc.url}/v1/actions?wait=maybe", json={"kind": "exec", "command": "true"}) as resp:
            assert resp.status == 400 and (await resp.json())["field"] == "wait"
        assert_whole(svc.runtime)


async def test_shutdown_cancels_in_flight_actions_and_answers_them():
    async with running_service() as svc, svc.client() as c:
        rt = svc.runtime
        env = await c.create_environment(memory_mb=32)
        pending = [asyncio.create_task(c.exec(env, "sleep 60")) for _ in range(N_CORES + 2)]
        # every request reached the engine before the shutdown (on a loaded machine that takes
        # seconds); a request still on its way would not be in flight, only unanswered
        for _ in range(3000):
            if len(rt.engine.running) == N_CORES and len(rt.engine.waiting) == 2:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"not all in flight: {len(rt.engine.running)} running, {len(rt.engine.waiting)} waiting")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await svc.runner.cleanup()
        results = await asyncio.gather(*pending)
        assert loop.time() - t0 < 10
        assert [r.status for r in results] == ["cancelled"] * (N_CORES + 2)
        rt.engine.check_invariants()
        assert not rt.engine.running and not rt.engine.waiting
        assert all(p.free == p.capacity for p in rt.engine.pool_states().values())


async def test_disconnect_watcher_works_without_handler_cancellation():
    # web.run_app / a plain AppRunner leaves handler_cancellation off: the watcher must cancel
    from aiohttp import web

    from tangram.service.app import RUNTIME_KEY, create_app

    app = create_app(config())
    runner = web.AppRunner(app)  # handler_cancellation defaults to False
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        rt = app[RUNTIME_KEY]
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"{url}/v1/actions", json={"kind": "exec", "command": "sleep 30"}))
            for _ in range(200):
                if rt.engine.running:
                    break
                await asyncio.sleep(0.01)
            req.cancel()
            with pytest.raises(asyncio.CancelledError):
                await req
        await settle(rt, timeout_s=5)
        assert rt.counts.get(("exec", "cancelled")) == 1
        assert_whole(rt)
    finally:
        await runner.cleanup()


@pytest.mark.skipif(N_CORES < 2, reason="needs 2 cores to widen onto")
async def test_an_unprofiled_range_runs_at_its_min_first_and_wider_once_its_class_has_run():
    body = {"kind": "exec", "command": "echo $TANGRAM_DOP", "class": "suite-a",
            "resources": {"cpu": {"min": 1, "max": N_CORES}}}
    async with running_service() as svc, svc.client() as c:
        first = await c.run_action(body)
        assert first.ok and first.allocation["dop"] == 1 and first.stdout == "1\n"
        second = await c.run_action(body)  # nothing else waits: the class's guess takes every core
        assert second.ok and second.allocation["dop"] == N_CORES and second.stdout == f"{N_CORES}\n"
        assert_whole(svc.runtime)
    cfg = config(scheduler={"learn_unprofiled": False})
    async with running_service(cfg) as svc, svc.client() as c:
        for _ in range(2):
            r = await c.run_action(body)
            assert r.ok and r.allocation["dop"] == 1


async def test_an_http_answer_that_is_not_text_is_given_as_base64_and_kept(caplog):
    """An upstream answering bytes that are not UTF-8 (an image, a page in an undeclared charset): the
    result is JSON (the body as base64; a declared charset decoded), on the wire and in the state store
    alike. Raw bytes once made the answer, and every later GET of it, a 500."""
    from aiohttp import web

    png = bytes(range(256))

    async def image(request):
        return web.Response(body=png, content_type="image/png")

    async def latin(request):
        return web.Response(body="café".encode("latin-1"), content_type="text/plain", charset="latin-1")

    app = web.Application()
    app.router.add_get("/png", image)
    app.router.add_get("/latin", latin)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with running_service(config(api_pools={"web": {"concurrency": 2}})) as svc, \
                aiohttp.ClientSession() as s:
            for path, body in (("png", {"base64": base64.b64encode(png).decode()}), ("latin", "café")):
                req = {"kind": "http", "url": f"http://127.0.0.1:{port}/{path}", "resources": {"api": "web"}}
                async with s.post(f"{svc.url}/v1/actions?wait=true", json=req) as resp:
                    out = await resp.json()
                assert resp.status == 200 and out["status"] == "succeeded", out
                assert out["output"]["body"] == body
                async with s.get(f"{svc.url}/v1/actions/{out['id']}") as resp:
                    assert resp.status == 200 and (await resp.json())["output"]["body"] == body
            assert_whole(svc.runtime)
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]  # e.g. the store's listener
    finally:
        await runner.cleanup()


async def test_environments_past_the_cap_are_refused_for_now_and_nothing_is_made():
    """``service.max_environments``: a caller's loop of POST /v1/environments stops at the cap with 503 and
    Retry-After (room comes as environments go); what was refused made nothing."""
    cfg = config(service={"max_environments": 2})
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        made = []
        for _ in range(2):
            async with s.post(f"{svc.url}/v1/environments", json={}) as resp:
                assert resp.status == 201
                made.append((await resp.json())["id"])
        async with s.post(f"{svc.url}/v1/environments", json={}) as resp:
            out = await resp.json()
            assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1, out
            assert "service.max_environments" in out["error"]
        assert sorted(e.id for e in svc.runtime.environments()) == sorted(made)
        async with s.delete(f"{svc.url}/v1/environments/{made[0]}") as resp:
            assert resp.status == 204
        async with s.post(f"{svc.url}/v1/environments", json={}) as resp:
            assert resp.status == 201
            made[0] = (await resp.json())["id"]
        for e in made:
            async with s.delete(f"{svc.url}/v1/environments/{e}") as resp:
                assert resp.status == 204
        assert_whole(svc.runtime)


async def test_a_delete_whose_removal_fails_can_be_sent_again(monkeypatch):
    """The node's engine fails to remove an environment: DELETE answers 502 and the environment stays
    listed (its actions are cancelled), so a second DELETE removes it. It was unlisted first: the error
    came back and no DELETE could reach it again."""
    from tangram.executors.local import LocalExecutor

    real, fails = LocalExecutor.destroy_environment, [RuntimeError("engine hiccup")]

    async def flaky(self, env_id):
        if fails:
            raise fails.pop()
        await real(self, env_id)

    monkeypatch.setattr(LocalExecutor, "destroy_environment", flaky)
    async with running_service() as svc, aiohttp.ClientSession() as s:
        async with s.post(f"{svc.url}/v1/environments", json={}) as resp:
            env = (await resp.json())["id"]
        async with s.delete(f"{svc.url}/v1/environments/{env}") as resp:
            out = await resp.json()
            assert resp.status == 502 and "engine hiccup" in out["error"], out
        assert [e.id for e in svc.runtime.environments()] == [env]
        async with s.delete(f"{svc.url}/v1/environments/{env}") as resp:
            assert resp.status == 204
        from tangram.service.app import STATE_KEY

        assert svc.runtime.environments() == []
        assert [row["id"] for row in svc.app[STATE_KEY].environments()] == []  # its row went with it
        assert_whole(svc.runtime)
