"""Hostile input at the service's edge: every malformed request is a 4xx naming its field, never a 500,
and nothing a caller sends makes the service hold unbounded memory or connections."""
from __future__ import annotations

import asyncio
import json
import resource

import aiohttp
import pytest

from tests.service_helpers import N_CORES, assert_whole, config, running_service

pytestmark = pytest.mark.timeout(120)


def _nested(depth: int) -> list:
    v: list = [1]
    for _ in range(depth - 1):
        v = [v]
    return v


async def _post(session, url, body=None, *, raw=None, headers=None):
    data = raw if raw is not None else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


async def test_a_billion_core_range_is_capped_not_materialised():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(5):
            st, body = await _post(s, f"{svc.url}/v1/actions",
                                   {"kind": "exec", "command": "echo ok", "resources": {"cpu": {"min": 1, "max": 10 ** 9}}})
            assert st == 200 and body["status"] == "succeeded", body
            assert 1 <= body["allocation"]["dop"] <= N_CORES
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown_kib < 64 * 1024, f"peak RSS grew by {grown_kib} KiB"  # a 10^9 tuple would be ~36 GiB
        st, body = await _post(s, f"{svc.url}/v1/actions",
                               {"kind": "exec", "command": "true", "resources": {"cpu": 10 ** 9}})
        assert st == 422 and body["field"] == "resources.cpu", body
        assert_whole(svc.runtime)


async def test_a_class_per_action_keeps_bounded_per_class_state():
    """``class`` comes from the client: one new class per action keeps the most recent classes' ACT
    samples for /v1/stats (and counts the dropped ones), never one entry per action."""
    from tangram.runtime.stats import MAX_CLASSES

    n = MAX_CLASSES + 44
    async with running_service() as svc, aiohttp.ClientSession() as s:
        for first in range(0, n, 25):
            got = await asyncio.gather(*(_post(s, f"{svc.url}/v1/actions", {"kind": "exec", "command": "true",
                                                                         "class": f"c{i}"})
                                         for i in range(first, min(n, first + 25))))
            assert all(st == 200 and b["status"] == "succeeded" for st, b in got), got
        async with s.get(f"{svc.url}/v1/stats") as r:
            stats = await r.json()
        assert len(stats["classes"]) == MAX_CLASSES and stats["classes_dropped"] == n - MAX_CLASSES
        assert f"c{n - 1}" in stats["classes"] and "c0" not in stats["classes"]
        assert svc.runtime.engine.estimator.classes() == n  # under its own bound (10,000)
        assert_whole(svc.runtime)


@pytest.mark.parametrize("body, status, field", [
    ({"kind": "exec", "command": "true", "class": "x" * (1 << 20)}, 413, "body"),  # past max_body_bytes
    ({"kind": "exec", "command": "true", "class": "x" * 10_000}, 400, "class"),
    ({"kind": "exec", "command": "echo \u0000 hi"}, 400, "command"),
    ({"kind": "exec", "command": "true", "env": {"A=B": "1"}}, 400, "env.A=B"),
    ({"kind": "exec", "command": "true", "env": {"A": "x\u0000y"}}, 400, "env.A"),
    ({"kind": "exec", "command": "true", "env": {"": "1"}}, 400, "env.<key>"),
    ({"kind": "exec", "command": "true", "env": {f"V{i}": "1" for i in range(300)}}, 400, "env"),
    ({"kind": "exec", "command": "true", "env": {"A": "x" * 40000}}, 400, "env.A"),
    ({"kind": "exec", "command": "true", "resources": {"cpu": list(range(1, 400))}}, 400, "resources.cpu"),
    ({"kind": "http", "url": "http://x/", "json": {"a": _nested(40)}}, 400, "json.a" + "[0]" * 30),
])
async def test_bad_fields_are_400_naming_them(body, status, field):
    async with running_service() as svc, aiohttp.ClientSession() as s:
        st, got = await _post(s, f"{svc.url}/v1/actions", body)
        assert (st, got.get("field")) == (status, field), got
        assert_whole(svc.runtime)


async def test_lone_surrogates_and_deep_json_are_400_not_500():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        # a lone surrogate is valid JSON text (an escape) but no valid Unicode string
        st, got = await _post(s, f"{svc.url}/v1/actions", raw='{"kind": "exec", "command": "echo \\ud800"}')
        assert (st, got["field"]) == (400, "command"), got
        st, got = await _post(s, f"{svc.url}/v1/environments", raw='{"labels": {"k": "\\udfff"}}')
        assert (st, got["field"]) == (400, "labels.k"), got
        st, got = await _post(s, f"{svc.url}/v1/actions", raw="[" * 100_000 + "]" * 100_000)
        assert (st, got["field"]) == (400, "body"), got
        st, got = await _post(s, f"{svc.url}/v1/actions", raw="\xff\xfe not json")
        assert (st, got["field"]) == (400, "body"), got


async def test_labels_are_bounded_and_internal_ones_reserved():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        url = f"{svc.url}/v1/environments"
        st, got = await _post(s, url, {"labels": {f"k{i}": "v" for i in range(10_000)}})
        assert (st, got["field"]) == (400, "labels"), got
        st, got = await _post(s, url, {"labels": {"k": "v" * 5000}})
        assert (st, got["field"]) == (400, "labels.k"), got
        st, got = await _post(s, url, {"labels": {"tangram.env": "someone-else"}})
        assert (st, got["field"]) == (400, "labels.tangram.env"), got
        assert svc.runtime.environments() == []


async def test_a_non_utf8_authorization_header_is_401():
    cfg = config(service={"token": "s3cret"})
    async with running_service(cfg) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert head.startswith(b"HTTP/1.1 401"), head[:200]


async def test_a_half_sent_request_head_is_dropped_and_a_stalled_body_is_408():
    cfg = config(service={"header_timeout_s": 0.5, "body_timeout_s": 0.5})
    async with running_service(cfg) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(b"POST /v1/actions HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the service
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"kind\"")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(200), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        # a well-behaved client on a kept-alive connection is unaffected
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.get(f"{svc.url}/healthz") as r:
                    assert r.status == 200
                await asyncio.sleep(0.7)
            async with s.get(f"{svc.url}/healthz") as r:
                assert r.status == 200


async def test_an_idle_keep_alive_connection_is_closed_after_the_service_keepalive(monkeypatch):
    """Between requests the head deadline does not run; the keep-alive timeout closes an idle connection
    (aiohttp's own default would hold it for an hour)."""
    from tangram.service import app as service_app

    monkeypatch.setattr(service_app, "KEEPALIVE_S", 0.5)
    async with running_service(config()) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()  # kept alive
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        rest = await asyncio.wait_for(reader.read(), 5)  # then nothing: the service closes the idle connection
        writer.close()
        assert rest == b""
