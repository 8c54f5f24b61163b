"""TangramClient: typed results, errors, lifecycle, and retrying only what is safe."""
from __future__ import annotations

import asyncio

import pytest

from tangram.client import ActionResult, TangramClient, TangramHTTPError, Timing
from tests.service_helpers import assert_whole, running_service

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


class _Counter(asyncio.Protocol):
    """A server that counts connections and hangs up on each at once (the service 'died')."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def connection_made(self, transport):
        self.counts[0] += 1
        transport.abort()


async def test_retries_only_idempotent_requests():
    counts = [0]
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Counter(counts), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
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
    finally:
        server.close()
        await server.wait_closed()


async def test_unreachable_service_is_status_zero():
    async with TangramClient("http://127.0.0.1:1", retries=0) as c:
        with pytest.raises(TangramHTTPError) as e:
            await c.health()
        assert e.value.status == 0


async def test_a_stalled_service_hits_the_client_deadline():
    """A service that accepts the connection and never answers: the request fails at the deadline."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)  # reads, never writes
    port = server.sockets[0].getsockname()[1]
    try:
        async with TangramClient(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=0) as c:
            with pytest.raises(TangramHTTPError) as e:
                await c.exec(None, "true")
            assert e.value.status == 0 and e.value.timed_out and "within 0.3 s" in e.value.message
    finally:
        server.close()
        await server.wait_closed()


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
