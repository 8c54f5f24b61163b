"""Hostile and malformed requests against a real ``tangram serve``: never a 5xx, never down, nothing leaked.

* A short, deterministic Schemathesis run (``scripts/fuzz_api.py``) generates requests from
  ``docs/openapi.yaml`` and checks every answer against it (status codes, headers, bodies; valid input
  accepted, invalid refused), then that the service still answers and holds nothing.
* Raw HTTP the spec cannot express (broken JSON, huge and stalled bodies, wrong content types, deep
  nesting, non-UTF-8, unknown methods), sent byte for byte over a socket: each a 4xx naming its field.
* Regressions for what fuzzing found.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.service_helpers import assert_whole, running_service, start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)
TOKEN = "fuzz-t0ken"
KEY = "fuzz-sandbox-key-0123456789"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Schemathesis needs Python 3.11 (the test requirements install it there)")
def test_schemathesis_short_run_finds_no_failure_and_leaves_nothing():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # fuzzing and stateful phases, a fixed budget and deterministic generation (the coverage phase's
    # thousand boundary cases run in the longer `scripts/fuzz_api.py` run)
    p = subprocess.run([sys.executable, "scripts/fuzz_api.py", "--json", "--phases", "fuzzing,stateful",
                        "--max-examples", "8", "--deterministic"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=220)
    assert p.stdout, p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert report["failures"] == [] and report["errors"] == [], report["output_tail"]
    assert report["server_errors"] == 0 and not any(k.startswith("5") for k in report["statuses"]), report
    assert report["service_alive"] and report["leaks"] == [] and report["serve_exit_code"] == 0, report
    # the run reached every route and got both answers and refusals
    documented = {f"{m} {path}" for m, path in _spec_operations() if path != "/sandbox/run_code"}
    assert documented <= set(report["by_operation"]), sorted(documented - set(report["by_operation"]))
    assert report["requests"] >= 100 and {"200", "201", "400"} <= set(report["statuses"]), report["statuses"]
    assert p.returncode == 0 and report["ok"]


# ---------------------------------------------------------------------------- #
# raw HTTP


def _req(method: bytes, path: bytes, body: bytes = b"", *, ctype: bytes | None = b"application/json",
         extra: bytes = b"", length: int | None = None) -> bytes:
    head = method + b" " + path + b" HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n"
    head += b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
    if ctype is not None:
        head += b"Content-Type: " + ctype + b"\r\n"
    if body or length is not None:
        head += b"Content-Length: " + str(len(body) if length is None else length).encode() + b"\r\n"
    return head + extra + b"\r\n" + body


def _nested_object(depth: int) -> bytes:
    return b'{"kind": "http", "url": "http://x/", "resources": {"api": "a"}, "json": ' + b'{"a": ' * depth + b"1" + \
        b"}" * depth + b"}"


SANDBOX = f"/sandbox/{KEY}/run_code".encode()
CHUNKED = b"Transfer-Encoding: chunked\r\n"
# (name, raw request, status, the field named, or what the HTTP parser's text says); 1 MiB is max_body_bytes
RAW_CASES = [
    ("invalid JSON", _req(b"POST", b"/v1/actions", b'{"kind": "exec",'), 400, "body"),
    ("JSON array, not an object", _req(b"POST", b"/v1/actions", b"[1, 2]"), 400, "body"),
    ("JSON null environment", _req(b"POST", b"/v1/environments", b"null"), 400, "body"),
    ("empty body", _req(b"POST", b"/v1/actions", b""), 400, "body"),
    ("trailing garbage", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "true"} x'), 400, "body"),
    ("100k-deep arrays", _req(b"POST", b"/v1/actions", b"[" * 100_000 + b"]" * 100_000), 400, "body"),
    ("1000-deep objects in json", _req(b"POST", b"/v1/actions", _nested_object(1000)), 400, "body"),
    ("40-deep objects in json", _req(b"POST", b"/v1/actions", _nested_object(40)), 400, "json" + ".a" * 31),
    ("non-UTF-8 body", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "\xff\xfe"}'), 400, "body"),
    ("lone surrogate", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "\\ud800"}'), 400, "command"),
    ("NaN timeout", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "true", "timeout_s": NaN}'),
     400, "timeout_s"),
    ("Infinity cores", _req(b"POST", b"/v1/actions",
                            b'{"kind": "exec", "command": "true", "resources": {"cpu": 1e999}}'), 400, "resources.cpu"),
    ("a 5000-digit integer", _req(b"POST", b"/v1/environments", b'{"memory_mb": ' + b"9" * 5000 + b"}"), 400, "body"),
    ("huge body", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "' + b"x" * (2 << 20) + b'"}'),
     413, "body"),
    ("huge declared length, no body", _req(b"POST", b"/v1/actions", length=1 << 40), 413, "body"),
    ("huge chunked body", _req(b"POST", b"/v1/actions", ctype=b"application/json", extra=CHUNKED)
     + b"".join(b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16)) for _ in range(40)) + b"0\r\n\r\n", 413, "body"),
    ("huge sandbox body", _req(b"POST", SANDBOX, b"x", length=1 << 40), 413, "body"),
    ("form content type", _req(b"POST", b"/v1/actions", b"kind=exec&command=true",
                               ctype=b"application/x-www-form-urlencoded"), 400, "body"),
    ("multipart content type", _req(b"POST", b"/v1/environments", b"--b\r\n\r\nx\r\n--b--",
                                    ctype=b"multipart/form-data; boundary=b"), 400, "body"),
    # the body is read as JSON whatever Content-Type says (curl -d sends a form type): valid JSON runs
    ("text content type, valid JSON", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "true"}',
                                           ctype=b"text/plain"), 200, None),
    ("text content type, no JSON", _req(b"POST", b"/v1/actions", b"echo hi", ctype=b"text/plain"), 400, "body"),
    ("sandbox: invalid JSON", _req(b"POST", SANDBOX, b'{"code": '), 422, "body"),
    ("sandbox: language not a string", _req(b"POST", SANDBOX, b'{"code": "", "language": {}}'), 422, "language"),
    ("sandbox: non-UTF-8", _req(b"POST", SANDBOX, b'{"code": "\xff", "language": "python"}'), 422, "body"),
    ("a method no route has", _req(b"PATCH", b"/v1/actions"), 405, "method"),
    ("a newer method", _req(b"QUERY", b"/v1/stats"), 405, "method"),
    ("method of another route", _req(b"PUT", b"/v1/environments/x"), 405, "method"),
    ("DELETE the collection", _req(b"DELETE", b"/v1/environments"), 405, "method"),
    ("bad wait flag", _req(b"POST", b"/v1/actions?wait=maybe", b'{"kind": "exec", "command": "true"}'), 400, "wait"),
    ("idempotency key not UTF-8", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "true"}',
                                       extra=b"Idempotency-Key: \xff\xfe\r\n"), 400, "Idempotency-Key"),
    ("percent-encoded garbage id", _req(b"GET", b"/v1/actions/%ff%00%2e%2e"), 404, None),
    ("unknown route", _req(b"GET", b"/v2/everything"), 404, None),
    # malformed HTTP itself: refused by aiohttp's parser before any handler, a 400 whose text says why
    ("invalid method token", _req(b"G(T", b"/healthz"), 400, b"Invalid method"),
    ("a method HTTP parsers do not know", _req(b"BREW", b"/v1/actions"), 400, b"Invalid method"),
    ("non-UTF-8 path", _req(b"GET", b"/v1/environments/\xff\xfe"), 400, b"Invalid char in url"),
    ("control character in a header", _req(b"POST", b"/v1/actions", b'{"kind": "exec", "command": "true"}',
                                           extra=b"Idempotency-Key: a\x01b\r\n"), 400, b"Invalid header value"),
    ("Content-Length and chunked", _req(b"POST", b"/v1/actions", b"0\r\n\r\n", extra=CHUNKED), 400,
     b"Transfer-Encoding can't be present with Content-Length"),
    ("a 64 KiB header", _req(b"GET", b"/healthz", extra=b"X-Tangram-Job: " + b"j" * (64 << 10) + b"\r\n"), 400,
     b"Got more than"),
]


def _send(port: int, raw: bytes, *, timeout: float = 20.0) -> tuple[int, dict | bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the service may answer (413) and close before a huge body is all sent
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
        if resp.status == 405:
            assert resp.getheader("Allow"), "a 405 lists the allowed methods"
    try:
        return resp.status, json.loads(body)
    except ValueError:
        return resp.status, body


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """``tangram serve`` on the embedded default config, but short head and body deadlines."""
    d = tmp_path_factory.mktemp("serve")
    (d / "token").write_text(TOKEN)
    (d / "key").write_text(KEY)
    (d / "service.yaml").write_text("service:\n  header_timeout_s: 1\n  body_timeout_s: 1\n")
    serve = start_serve(["--config", str(d / "service.yaml"), "--port", "0", "--token-file", str(d / "token"),
                         "--state-dir", str(d / "state"), "--sandbox-key-file", str(d / "key"), "--log-level", "WARNING"])
    try:
        yield serve.proc, int(serve.url.rsplit(":", 1)[1])
    finally:
        assert serve.stop(grace_s=30) == 0, serve.output()[-3000:]


@pytest.mark.parametrize("name,raw,status,field", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_requests_are_answered_without_a_5xx(serve, name, raw, status, field):
    proc, port = serve
    got, body = _send(port, raw)
    assert got == status, (name, body)
    if isinstance(field, bytes):  # the parser's answer
        assert isinstance(body, bytes) and field in body, (name, body)
    elif field is not None:
        assert isinstance(body, dict) and body.get("field") == field and body.get("error"), (name, body)
    assert proc.poll() is None


def test_slow_and_half_sent_requests_are_cut_off_and_nothing_leaks(serve):
    proc, port = serve
    # a head that never ends: the connection is closed after header_timeout_s (1 s here)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/actions HTTP/1.1\r\nHost: fuzz\r\n")
        t0 = time.monotonic()
        assert sock.recv(100) == b"" and time.monotonic() - t0 < 8
    # a slowloris body: a byte a little slower than the body deadline allows, then 408 naming the body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_req(b"POST", b"/v1/actions", length=100) + b'{"kind"')
        for ch in b': "exec"':
            time.sleep(0.3)
            try:
                sock.sendall(bytes([ch]))
            except (BrokenPipeError, ConnectionResetError):
                break
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 408 and json.loads(resp.read())["field"] == "body"
    # many half-open connections at once do not stop a well-behaved client
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
        status, health = _send(port, b"GET /healthz HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n")
        assert status == 200 and health["status"] == "ok"
    finally:
        for s in socks:
            s.close()
    # after every case above: still serving, nothing running, queued or held
    status, stats = _send(port, _req(b"GET", b"/v1/stats", ctype=None))
    assert status == 200 and stats["admission"]["held"] == 0
    for name, pool in stats["pools"].items():
        assert pool["free"] == pool["capacity"], (name, pool)
    status, envs = _send(port, _req(b"GET", b"/v1/environments", ctype=None))
    assert status == 200 and envs["environments"] == []
    assert proc.poll() is None


# ---------------------------------------------------------------------------- #
# regressions for what fuzzing found


async def test_a_405_says_which_methods_the_route_has():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        async with s.request("TRACE", f"{svc.url}/v1/stats") as r:
            assert r.status == 405 and r.headers["Allow"] == "GET, HEAD"
            assert (await r.json()) == {"error": "method TRACE is not allowed here (allowed: GET, HEAD)",
                                        "field": "method"}


async def test_whole_numbers_written_as_floats_are_integers():
    # JSON (and JSON Schema) make no difference between 2 and 2.0
    async with running_service() as svc, aiohttp.ClientSession() as s:
        async with s.post(f"{svc.url}/v1/environments", json={"memory_mb": 64.0}) as r:
            assert r.status == 201, await r.text()
            env = (await r.json())["id"]
        assert svc.runtime.environment(env).memory_mb == 64
        async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "echo ok",
                                                         "resources": {"cpu": {"min": 1.0, "max": 1.0}}}) as r:
            assert r.status == 200 and (await r.json())["stdout"] == "ok\n"
        async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "true",
                                                         "resources": {"cpu": 1.5}}) as r:
            assert r.status == 400 and (await r.json())["field"] == "resources.cpu"
        async with s.delete(f"{svc.url}/v1/environments/{env}") as r:
            assert r.status == 204
        assert_whole(svc.runtime)


async def test_an_idempotency_key_is_visible_ascii():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        for key in ("a\tb", "caf\u00e9", "x" * 257):
            async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "true"},
                              headers={"Idempotency-Key": key}) as r:
                assert r.status == 400 and (await r.json())["field"] == "Idempotency-Key", key
        async with s.post(f"{svc.url}/v1/actions", json={"kind": "exec", "command": "true"},
                          headers={"Idempotency-Key": "run 7/step 3 {a=b}"}) as r:
            assert r.status == 200
        assert_whole(svc.runtime)


async def test_an_unknown_empty_field_name_is_named():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        for path, body in (("/v1/environments", {"": 1}), ("/v1/actions", {"kind": "exec", "command": "true", "": 1})):
            async with s.post(f"{svc.url}{path}", json=body) as r:
                assert r.status in (400, 422) and (await r.json())["field"] == "<empty key>", path
        # the SandboxFusion route ignores a field SandboxFusion does not know, as SandboxFusion does
        async with s.post(f"{svc.url}/sandbox/run_code", json={"code": "", "language": "bash", "": 1}) as r:
            assert r.status == 200 and (await r.json())["status"] == "Success"


async def test_an_environment_body_of_null_is_refused_and_no_body_is_the_defaults():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        async with s.post(f"{svc.url}/v1/environments", data=b"null",
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["field"] == "body"
        assert svc.runtime.environments() == []
        async with s.post(f"{svc.url}/v1/environments") as r:
            assert r.status == 201
            env = (await r.json())["id"]
        async with s.delete(f"{svc.url}/v1/environments/{env}") as r:
            assert r.status == 204


async def test_a_sandbox_language_that_is_not_a_string_is_422_not_500():
    async with running_service() as svc, aiohttp.ClientSession() as s:
        for language in ({}, [], 3, None):
            async with s.post(f"{svc.url}/sandbox/run_code", json={"code": "", "language": language}) as r:
                body = await r.json()
                assert r.status == 422 and body["field"] == "language", body


# ---------------------------------------------------------------------------- #
# the spec covers every route


def _spec_operations() -> set[tuple[str, str]]:
    import yaml

    doc = yaml.safe_load((REPO / "docs" / "openapi.yaml").read_text())
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item if m in methods}


def test_every_route_the_service_registers_is_in_the_spec():
    from tangram.service.app import create_app
    from tests.service_helpers import config

    served = set()
    # the keyed sandbox route (a token and a key), and the keyless one (neither)
    for cfg in (config(service={"token": TOKEN}, sandbox_fusion={"key": KEY}), config()):
        for route in create_app(cfg).router.routes():
            info = route.resource.get_info()
            path = info.get("path") or info.get("formatter")
            if route.method != "HEAD":  # aiohttp answers HEAD wherever GET is (RFC 9110)
                served.add((route.method, path))
    assert {("POST", "/sandbox/{key}/run_code"), ("POST", "/sandbox/run_code"), ("GET", "/metrics")} <= served
    spec = _spec_operations()
    assert served - spec == set(), "routes missing from docs/openapi.yaml"
    assert spec - served == set(), "documented routes the service does not have"
