"""``docs/openapi.yaml`` is the HTTP contract: the file is a valid OpenAPI 3.1 document (openapi-core
checks it on load), and every request below, sent to a real service, gets a response that the
document allows for that route, method and status (body schema and required headers)."""
from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from tests.service_helpers import config, running_service

pytestmark = pytest.mark.timeout(120)
SPEC = OpenAPI.from_file_path(str(Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"))
TOKEN = "t0ken"


class Checker:
    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.s = session
        self.url = url
        self.seen: set[tuple[str, str, int]] = set()

    async def call(self, method: str, path: str, pattern: str, *, body=None, raw: bytes | None = None,
                   query: dict | None = None, auth: bool = True, headers: dict | None = None,
                   check_request: bool = True) -> tuple[int, object]:
        hdrs = dict(headers or {})
        if auth:
            hdrs["Authorization"] = f"Bearer {TOKEN}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        async with self.s.request(method, self.url + path, data=data, params=query, headers=hdrs) as r:
            payload = await r.read()
            ctype = r.headers.get("Content-Type", "").split(";")[0]
            status, rheaders = r.status, dict(r.headers)
        view_args = {k[1:-1]: v for k, v in zip(pattern.split("/"), path.split("/")) if k.startswith("{")} or None
        req = MockRequest(self.url, method.lower(), path, path_pattern=pattern, args=query or {}, headers=hdrs,
                          view_args=view_args,
                          data=data, content_type="application/json" if data is not None else "")
        if check_request:
            SPEC.validate_request(req)  # what we sent is what the contract describes
        SPEC.validate_response(req, MockResponse(payload, status_code=status, headers=rheaders,
                                                 content_type=ctype or "application/json"))
        self.seen.add((method, pattern, status))
        return status, (json.loads(payload) if ctype == "application/json" and payload else payload)


async def test_real_responses_match_the_contract():
    cfg = config(service={"token": TOKEN, "max_queued_per_job": 2})
    async with running_service(cfg) as svc, aiohttp.ClientSession() as s:
        c = Checker(s, svc.url)
        assert (await c.call("GET", "/healthz", "/healthz", auth=False))[0] == 200
        assert (await c.call("GET", "/v1/stats", "/v1/stats", auth=False, check_request=False))[0] == 401
        st, env = await c.call("POST", "/v1/environments", "/v1/environments",
                               body={"memory_mb": 256, "labels": {"k": "v"}})
        assert st == 201
        eid = env["id"]
        assert (await c.call("GET", f"/v1/environments/{eid}", "/v1/environments/{id}"))[0] == 200
        assert (await c.call("GET", "/v1/environments", "/v1/environments"))[0] == 200
        st, _ = await c.call("POST", f"/v1/environments/{eid}/renew", "/v1/environments/{id}/renew")
        assert st == 200
        st, res = await c.call("POST", "/v1/actions", "/v1/actions", headers={"Idempotency-Key": "once"},
                               body={"kind": "exec", "command": "echo hi", "environment": eid})
        assert st == 200 and res["stdout"] == "hi\n"
        st, fed = await c.call("POST", "/v1/actions", "/v1/actions", body={"kind": "exec", "command": "cat",
                                                                           "stdin": "in\0put"})
        assert st == 200 and fed["stdout"] == "in\0put"
        assert (await c.call("GET", f"/v1/actions/{res['id']}", "/v1/actions/{id}"))[0] == 200
        st, pend = await c.call("POST", "/v1/actions", "/v1/actions", query={"wait": "false"},
                                body={"kind": "exec", "command": "sleep 30", "environment": eid},
                                headers={"X-Tangram-Job": "j"})
        assert st == 202
        await c.call("POST", "/v1/actions", "/v1/actions", query={"wait": "false"},
                     body={"kind": "exec", "command": "sleep 30"}, headers={"X-Tangram-Job": "j"})
        st, _ = await c.call("POST", "/v1/actions", "/v1/actions", query={"wait": "false"},
                             body={"kind": "exec", "command": "true"}, headers={"X-Tangram-Job": "j"})
        assert st == 429
        assert (await c.call("GET", f"/v1/actions/{pend['id']}", "/v1/actions/{id}"))[0] == 200
        assert (await c.call("DELETE", f"/v1/actions/{pend['id']}", "/v1/actions/{id}"))[0] in (200, 202)
        # refusals: each names its field in the documented error shape
        assert (await c.call("POST", "/v1/actions", "/v1/actions", body={"kind": "exec"},
                             check_request=False))[0] == 400
        assert (await c.call("POST", "/v1/actions", "/v1/actions", raw=b"[" * 50_000,
                             check_request=False))[0] == 400
        assert (await c.call("POST", "/v1/actions", "/v1/actions",
                             body={"kind": "exec", "command": "true", "resources": {"cpu": 10 ** 6}}))[0] == 422
        assert (await c.call("POST", "/v1/actions", "/v1/actions", raw=b"x" * (2 << 20),
                             check_request=False))[0] == 413
        assert (await c.call("GET", "/v1/actions/nope", "/v1/actions/{id}"))[0] == 404
        assert (await c.call("GET", "/v1/stats", "/v1/stats"))[0] == 200
        assert (await c.call("DELETE", f"/v1/environments/{eid}", "/v1/environments/{id}"))[0] == 204
        assert (await c.call("DELETE", f"/v1/environments/{eid}", "/v1/environments/{id}"))[0] == 404
        async with s.get(f"{svc.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and "text/plain" in r.headers["Content-Type"]
    assert len(c.seen) >= 15
