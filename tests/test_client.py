"""TangramClient: typed results, errors, lifecycle, and retrying only what is safe."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from tangram.client import ActionResult, TangramClient, TangramHTTPError, Timing
from tangram.service.app import GATE_KEY
from tests.service_helpers import assert_whole, config, local_app, running_service, settle

pytestmark = pytest.mark.timeout(60)


async def test_typed_results_and_lifecycle():
    async with running_service() as svc:
        c = svc.client()
        async with c:
            r = await c.exec(None, "echo out; echo err >&2", cpu=1, timeout_s=10)
            assert isinstance(r, ActionResult) and isinstance(r.timing, Timing)
            assert (r.status, r.stdout, r.stderr, r.exit_code) == ("succeeded", "out\n", "err\n", 0)
            assert r.ok and r.finished and r.timing.total_s >= r.timing.exec_s
            aid = await c.submit({"kind": "exec", "command": "echo later"})
            done = await c.wait(aid, timeout_s=10)
            assert done.stdout == "later\n"
            raw = await c.run_action({"kind": "exec", "command": "exit 7"})
            assert raw.status == "failed" and raw.exit_code == 7
        await c.close()  # idempotent
        await c.close()
        with pytest.raises(RuntimeError):
            await c.health()
        assert_whole(svc.runtime)


async def test_errors_carry_status_message_and_field():
    async with running_service() as svc, svc.client() as c:
        with pytest.raises(TangramHTTPError) as e:
            await c.exec(None, "true", cpu={"min": 0, "max": 1})
        assert e.value.status == 400 and e.value.field == "resources.cpu.min" and ">= 1" in e.value.message
        with pytest.raises(TangramHTTPError) as e:
            await c.exec("env-missing", "true")
        assert e.value.status == 404 and "env-missing" in e.value.message
        with pytest.raises(TangramHTTPError) as e:
            await c.exec(None, "true", cpu=999)
        assert e.value.status == 422


@contextlib.asynccontextmanager
async def _serving(protocol_factory):
    """A raw TCP server on a free local port (a service that misbehaves below HTTP); yields the port."""
    server = await asyncio.get_running_loop().create_server(protocol_factory, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


class _Counter(asyncio.Protocol):
    """A server that counts connections and hangs up on each at once (the service 'died')."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def connection_made(self, transport):
        self.counts[0] += 1
        transport.abort()


async def test_retries_only_idempotent_requests():
    counts = [0]
    async with _serving(lambda: _Counter(counts)) as port:
        async with TangramClient(f"http://127.0.0.1:{port}", retries=2, retry_backoff_s=0.01) as c:
            with pytest.raises(TangramHTTPError) as e:
                await c.get_action("x")
            # GET: tried 1 + 2 times (aiohttp may add its own retry of an idempotent request)
            assert e.value.status == 0 and counts[0] >= 3
            counts[0] = 0
            with pytest.raises(TangramHTTPError):
                await c.exec(None, "true")
            assert counts[0] == 1  # POST /v1/actions: never retried, it may have started
            counts[0] = 0
            with pytest.raises(TangramHTTPError):
                await c.delete_environment("e")
            assert counts[0] >= 3


class _CutShort(asyncio.Protocol):
    """A server that answers each request with a body shorter than its Content-Length, then hangs up."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if b"\r\n\r\n" in data:
            self.counts[0] += 1
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
                                 b"\r\n{\"status\": \"su")
            self.transport.close()


async def test_an_answer_cut_off_mid_body_is_a_lost_connection():
    """Not aiohttp's own error escaping: status 0, retried where resending is safe (a GET, a POST under an
    Idempotency-Key), not otherwise."""
    counts = [0]
    async with _serving(lambda: _CutShort(counts)) as port:
        async with TangramClient(f"http://127.0.0.1:{port}", retries=2, retry_backoff_s=0.01) as c:
            with pytest.raises(TangramHTTPError) as e:
                await c.get_action("x")
            assert e.value.status == 0 and "cannot reach" in e.value.message and counts[0] == 3
            counts[0] = 0
            with pytest.raises(TangramHTTPError) as e:
                await c.exec(None, "true")
            assert e.value.status == 0 and counts[0] == 1
            counts[0] = 0
            with pytest.raises(TangramHTTPError) as e:
                await c.exec(None, "true", idempotency_key="k1")
            assert e.value.status == 0 and counts[0] == 3


async def test_unreachable_service_is_status_zero():
    async with TangramClient("http://127.0.0.1:1", retries=0) as c:
        with pytest.raises(TangramHTTPError) as e:
            await c.health()
        assert e.value.status == 0


async def test_a_stalled_service_hits_the_client_deadline():
    """A service that accepts the connection and never answers: the request fails at the deadline."""
    async with _serving(asyncio.Protocol) as port:  # reads, never writes
        async with TangramClient(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=0) as c:
            with pytest.raises(TangramHTTPError) as e:
                await c.exec(None, "true")
            assert e.value.status == 0 and e.value.timed_out and "within 0.3 s" in e.value.message


def test_token_from_argument_file_or_environment(tmp_path, monkeypatch):
    from tangram.client import resolve_token

    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    monkeypatch.delenv("TANGRAM_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/tangram/token here
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert resolve_token() is None
    assert resolve_token("given", f) == "given" and resolve_token(None, f) == "from-file"
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(f))
    assert resolve_token() == "from-file"
    monkeypatch.setenv("TANGRAM_TOKEN", "from-env")
    assert resolve_token() == "from-env"
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_token(None, tmp_path / "missing")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        resolve_token(None, tmp_path / "empty")
    monkeypatch.delenv("TANGRAM_TOKEN")
    monkeypatch.delenv("TANGRAM_TOKEN_FILE")
    (tmp_path / ".config" / "tangram").mkdir(parents=True)
    (tmp_path / ".config" / "tangram" / "token").write_text("written-by-serve\n")
    assert resolve_token() == "written-by-serve"  # the file `tangram serve` writes by default
    c = TangramClient("http://127.0.0.1:1", token="from-arg")
    assert "from-arg" not in repr(c)


ONE_CORE = [{"name": "local", "executor": "local", "cores": 1, "memory_mb": 4096}]


async def test_refused_for_now_raises_at_once_by_default_and_says_when_to_come_back():
    cfg = config(cpu_nodes=ONE_CORE, service={"max_queued_per_job": 2, "max_queued_total": 100})
    async with running_service(cfg) as svc, svc.client() as c:
        outcomes = await asyncio.gather(*(c.exec(None, "sleep 0.3") for _ in range(5)), return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, TangramHTTPError)]
        assert refused and all(e.status == 429 and e.retry_after_s >= 1 for e in refused), outcomes
        assert c.admission_waits == 0
        await _settled(svc)


async def test_refused_for_now_waits_and_is_sent_again_within_admission_wait_s():
    """Past the job's cap (429) and the service's (503) every action still runs, once: the client
    waited as the service's Retry-After said, and each result says how long it waited."""
    for caps in ({"max_queued_per_job": 2, "max_queued_total": 100}, {"max_queued_per_job": 100, "max_queued_total": 2}):
        cfg = config(cpu_nodes=ONE_CORE, service=caps)
        async with running_service(cfg) as svc, svc.client(admission_wait_s=120) as c:
            rs = await asyncio.gather(*(c.exec(None, f"echo {i}; sleep 0.2") for i in range(6)))
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(6)] and all(r.ok for r in rs)
            refused = svc.app[GATE_KEY].refused
            assert refused[429] + refused[503] == c.admission_waits > 0, (caps, refused)
            waited = [r.admission_wait_s for r in rs]
            assert sum(1 for w in waited if w > 0) >= 1 and sum(waited) <= c.admission_waited_s + 1e-6
            assert min(w for w in waited if w > 0) >= 1.0  # at least the service's Retry-After (1 s here)
            assert svc.runtime.statistics.counts.get(("exec", "succeeded")) == 6  # none ran twice
            await _settled(svc)


async def test_the_wait_is_bounded_and_a_refusal_without_retry_after_is_not_waited_for():
    from aiohttp import web

    hits = {"with": 0, "without": 0}

    async def refuse_with(request):
        hits["with"] += 1
        return web.json_response({"error": "full"}, status=503, headers={"Retry-After": "1"})

    async def refuse_without(request):
        hits["without"] += 1
        return web.json_response({"error": "slow down"}, status=429)

    async with local_app([("POST", "/with/v1/actions", refuse_with),
                          ("POST", "/without/v1/actions", refuse_without)]) as url:
        async with TangramClient(f"{url}/with", admission_wait_s=1.5) as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TangramHTTPError) as e:
                await c.run_action({"kind": "exec", "command": "true"})
            assert e.value.status == 503 and e.value.retry_after_s == 1.0
            assert 1.5 <= loop.time() - t0 < 10 and 2 <= hits["with"] <= 3  # waited its 1.5 s, then raised
            assert c.admission_waits == hits["with"] - 1 and 1.5 - 1e-3 <= c.admission_waited_s < 2.0
        async with TangramClient(f"{url}/without", admission_wait_s=60) as c:
            with pytest.raises(TangramHTTPError) as e:
                await c.run_action({"kind": "exec", "command": "true"})
            assert e.value.status == 429 and e.value.retry_after_s is None and hits["without"] == 1


def test_retry_after_in_seconds_or_as_an_http_date():
    import email.utils
    import time

    from tangram.client import retry_after_s

    assert retry_after_s("7") == 7.0 and retry_after_s("0") == 0.0 and retry_after_s("-3") == 0.0
    soon = email.utils.formatdate(time.time() + 120, usegmt=True)
    assert 100 < retry_after_s(soon) <= 121
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0
    for bad in (None, "", "soon", "nan"):
        assert retry_after_s(bad) is None
    with pytest.raises(ValueError, match="admission_wait_s"):
        TangramClient("http://127.0.0.1:1", admission_wait_s=-1)


async def _settled(svc) -> None:
    await settle(svc.runtime, timeout_s=20)
    assert_whole(svc.runtime)


async def test_a_named_job_has_its_own_cap_and_share():
    """Two clients on one address, each naming its job (X-Tangram-Job): one at its cap is refused, the
    other is not; unnamed, they would be one job (the address)."""
    cfg = config(cpu_nodes=ONE_CORE, service={"max_queued_per_job": 2, "max_queued_total": 100})
    async with running_service(cfg) as svc, svc.client(job="run-a") as a, svc.client(job="run-b") as b, \
            svc.client() as anon:
        ids = [await a.submit({"kind": "exec", "command": "sleep 30"}) for _ in range(2)]
        with pytest.raises(TangramHTTPError) as e:
            await a.submit({"kind": "exec", "command": "true"})
        assert e.value.status == 429 and "'run-a'" in e.value.message
        ids.append(await b.submit({"kind": "exec", "command": "true"}))  # its own cap
        ids.append(await anon.submit({"kind": "exec", "command": "true"}))  # the address's
        assert {"run-a", "run-b"} <= set(svc.app[GATE_KEY]._live) | set(svc.app[GATE_KEY]._held)
        for aid in ids:
            await a.cancel(aid)
        await _settled(svc)
    for bad in ("", "x" * 129, "a\nb", "jöb", 7):
        with pytest.raises(ValueError, match="job"):
            TangramClient("http://127.0.0.1:1", job=bad)


async def test_closing_the_client_ends_a_request_waiting_to_be_let_in():
    from aiohttp import web

    async def refuse(request):
        return web.json_response({"error": "full"}, status=503, headers={"Retry-After": "1"})

    async with local_app([("POST", "/v1/actions", refuse)]) as url:
        c = TangramClient(url, admission_wait_s=600)
        task = asyncio.create_task(c.run_action({"kind": "exec", "command": "true"}))
        await asyncio.sleep(0.5)  # refused at once, then waiting its Retry-After (1-1.5 s)
        assert not task.done()
        await c.close()
        with pytest.raises(TangramHTTPError) as e:
            await asyncio.wait_for(task, 5)
        assert e.value.status == 0 and "closed" in e.value.message
