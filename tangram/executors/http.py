"""HTTP executor: makes the real API call of an ``api:<name>`` action.

Dumb on purpose: the basic manager already decided that the call may go out
now (a concurrency slot and quota are held), so this only sends the request
and reports ``output = {"status", "body", "latency_s"}``; a non-2xx answer is
``status="failed"``. The upstream's rate-limit headers (``Retry-After``,
``X-RateLimit-*``, ``RateLimit-*``) go back in ``ExecResult.rate_headers``: the
runtime hands them to the basic manager, which aligns its books (and re-queues
a call answered 429). ``aiohttp`` is imported lazily (the core never imports it).
"""
from __future__ import annotations

import asyncio
import base64
import json as _json
import time
from typing import Any, Mapping

from tangram.executors.base import FAILED, SUCCEEDED, TIMEOUT, ExecResult

METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_RATE_HEADERS = ("retry-after", "x-ratelimit-", "ratelimit-")


class HttpExecutor:
    """One shared ``aiohttp.ClientSession``; an async context manager; ``close()`` is idempotent."""

    name = "http"

    def __init__(self, *, default_timeout_s: float = 60.0, max_body_bytes: int = 16 << 20,
                 session: Any = None):
        if not default_timeout_s > 0:
            raise ValueError(f"default_timeout_s: must be positive, got {default_timeout_s!r}")
        self.default_timeout_s = float(default_timeout_s)
        self.max_body_bytes = int(max_body_bytes)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> "HttpExecutor":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _get_session(self) -> Any:
        if self._session is None or self._session.closed:
            import aiohttp  # lazy

            # no connection limit here: the basic manager is the traffic control
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._own_session = True
        return self._session

    async def close(self) -> None:
        s, self._session = self._session, None
        if s is not None and self._own_session and not s.closed:
            await s.close()

    async def call(self, url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None,
                   json: Any = None, body: str | bytes | None = None,
                   timeout_s: float | None = None) -> ExecResult:
        """Send one request; never raises for network errors (they are a ``failed`` result)."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: must be an http(s) URL, got {url!r}")
        m = str(method).upper()
        if m not in METHODS:
            raise ValueError(f"method: must be one of {sorted(METHODS)}, got {method!r}")
        if json is not None and body is not None:
            raise ValueError("body: give either json or body, not both")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        import aiohttp  # lazy

        timeout = float(timeout_s or self.default_timeout_s)
        session = self._get_session()
        t0 = time.perf_counter()
        details: dict[str, Any] = {"method": m, "url": url}

        async def send() -> tuple[int, bytes, str, dict[str, str]]:
            async with session.request(m, url, headers=dict(headers or {}), json=json, data=body) as resp:
                rate = {k: v for k, v in resp.headers.items() if k.lower().startswith(_RATE_HEADERS)}
                raw = await resp.content.read(self.max_body_bytes)
                return resp.status, raw, resp.headers.get("Content-Type", ""), rate

        try:
            status, raw, ctype, rate = await asyncio.wait_for(send(), timeout)
        except asyncio.TimeoutError:
            latency = time.perf_counter() - t0
            return ExecResult(status=TIMEOUT, output={"status": None, "body": None, "latency_s": latency},
                              error=f"no answer within {timeout:g} s", details=details)
        except asyncio.CancelledError:
            raise  # the aiohttp request is aborted with the task; nothing else runs
        except aiohttp.ClientError as e:
            latency = time.perf_counter() - t0
            return ExecResult(status=FAILED, output={"status": None, "body": None, "latency_s": latency},
                              error=f"{type(e).__name__}: {e}", details=details)
        latency = time.perf_counter() - t0
        out = {"status": status, "body": _decode(raw, ctype), "latency_s": latency}
        ok = 200 <= status < 300
        return ExecResult(status=SUCCEEDED if ok else FAILED, exit_code=None, output=out,
                          error=None if ok else f"HTTP {status}", rate_headers=dict(rate) if rate else None,
                          details=details)

    async def run(self, request: Mapping[str, Any], *, timeout_s: float | None = None) -> ExecResult:
        """Run a payload ``{"url", "method", "headers", "json" | "body", "timeout_s"}``."""
        if not isinstance(request, Mapping):
            raise ValueError(f"request: expected a mapping, got {type(request).__name__}")
        unknown = set(request) - {"url", "method", "headers", "json", "body", "timeout_s"}
        if unknown:
            raise ValueError(f"request: unknown keys {sorted(unknown)}")
        if "url" not in request:
            raise ValueError("request.url: is required")
        return await self.call(request["url"], method=request.get("method", "GET"),
                               headers=request.get("headers"), json=request.get("json"),
                               body=request.get("body"), timeout_s=timeout_s or request.get("timeout_s"))


def _decode(raw: bytes, content_type: str) -> Any:
    """JSON bodies as objects, text as str (its declared charset, else UTF-8), anything else (an image,
    text in an undeclared charset) as ``{"base64": ...}``: every result is JSON, for the wire and the
    state store alike (raw bytes once made every answer about the action a 500)."""
    if "json" in content_type:
        try:
            return _json.loads(raw)
        except ValueError:
            pass
    charset = next((p.split("=", 1)[1].strip().strip('"') for p in content_type.split(";")[1:]
                    if p.strip().lower().startswith("charset=")), None)
    for enc in ([charset] if charset else []) + ["utf-8"]:
        try:
            return raw.decode(enc)
        except (UnicodeDecodeError, LookupError):  # LookupError: a charset Python does not know
            pass
    return {"base64": base64.b64encode(raw).decode("ascii")}
