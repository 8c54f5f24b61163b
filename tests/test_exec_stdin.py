"""An exec action's ``stdin``: text of any size or character fed to the command, then EOF, through a real
service and the local executor; checked at the wire (400 naming ``stdin``), never kept once the action
ended, and an exec without it reads EOF at once as before."""
from __future__ import annotations

import aiohttp
import pytest

from tangram.core.errors import DemandError
from tangram.service import wire
from tangram.service.wire import parse_action
from tests.service_helpers import config, running_service

pytestmark = pytest.mark.timeout(120)

# quotes, a shell's $ and backquotes, backslashes, printf's %, non-ASCII, CRLF, no newline at the end
TRICKY = "line 1 'single' \"double\" `tick` $HOME ${x} $(echo no)\n\\n \\\\ %s %d\r\n\ttab é ü 中文 😀\nlast"
MIB = 1 << 20


def test_the_wire_takes_a_string_and_names_stdin_for_anything_else(monkeypatch):
    got = parse_action({"kind": "exec", "command": "cat", "stdin": TRICKY + "\0after a NUL"})
    assert bytes(got["payload"]["stdin"]) == (TRICKY + "\0after a NUL").encode()
    assert bytes(parse_action({"kind": "exec", "command": "cat", "stdin": ""})["payload"]["stdin"]) == b""
    assert "stdin" not in parse_action({"kind": "exec", "command": "cat", "stdin": None})["payload"]
    assert "stdin" not in parse_action({"kind": "exec", "command": "cat"})["payload"]
    for bad in (5, ["a"], {"a": "b"}, True):
        with pytest.raises(DemandError) as e:
            parse_action({"kind": "exec", "command": "cat", "stdin": bad})
        assert e.value.field == "stdin" and "must be a string" in str(e.value)
    monkeypatch.setitem(wire.LIMITS, "stdin", 8)
    parse_action({"kind": "exec", "command": "cat", "stdin": "12345678"})
    with pytest.raises(DemandError) as e:
        parse_action({"kind": "exec", "command": "cat", "stdin": "123456789"})
    assert e.value.field == "stdin" and "at most 8 characters" in str(e.value)
    with pytest.raises(DemandError) as e:  # an exec's field only
        parse_action({"kind": "http", "url": "http://x", "stdin": "a"})
    assert e.value.field == "stdin"


async def test_a_real_service_feeds_stdin_to_the_command_byte_for_byte(monkeypatch):
    cfg = config(service={"max_body_bytes": 4 * MIB})
    async with running_service(cfg) as svc, svc.client() as c:
        r = await c.exec(None, "cat", stdin=TRICKY, timeout_s=30)
        assert r.status == "succeeded" and r.stdout == TRICKY
        # a megabyte (past an env value's 32 KiB and Linux's 128 KiB a string), lines of every kind
        big = (TRICKY + "\n") * (MIB // len((TRICKY + "\n").encode()) + 1)
        assert len(big.encode()) > MIB
        r = await c.exec(None, "cat > f && wc -c < f && cat f", stdin=big, timeout_s=60)
        n, _, echoed = r.stdout.partition("\n")
        assert r.status == "succeeded" and int(n) == len(big.encode()) and echoed == big and not r.truncated
        # NUL passes through (JSON carries \u0000); the command reads EOF after the input, so it ends
        r = await c.exec(None, "od -An -c | tr -s ' '", stdin="a\0b", timeout_s=30)
        assert r.stdout.split() == ["a", "\\0", "b"]
        # without stdin the command reads EOF at once, as before; an empty stdin too
        for kw in ({}, {"stdin": ""}):
            r = await c.exec(None, "wc -c", timeout_s=10, **kw)
            assert r.status == "succeeded" and r.stdout.strip() == "0", kw
        # a test-suite pattern: the first step takes the input, the next reads EOF
        r = await c.exec(None, "{ cat > sol ; } && { cat ; wc -c < sol ; }", stdin="abc", timeout_s=30)
        assert r.stdout.strip() == "3"
        # the input is not kept with the finished action (the service keeps those by the 100,000)
        s = await c.submit({"kind": "exec", "command": "cat >/dev/null", "stdin": "x" * 1000, "timeout_s": 30})
        assert (await c.wait(s, timeout_s=30)).status == "succeeded"
        assert svc.runtime._job(s).action.payload["stdin"] == bytearray()
        # the wire's 400s, sent as a client would
        monkeypatch.setitem(wire.LIMITS, "stdin", 1024)
        async with aiohttp.ClientSession() as s:
            for bad, why in ((42, "must be a string"), ("x" * 1025, "at most 1024 characters")):
                async with s.post(svc.url + "/v1/actions", json={"kind": "exec", "command": "cat", "stdin": bad}) as a:
                    body = await a.json()
                    assert a.status == 400 and body["field"] == "stdin" and why in body["error"], body
