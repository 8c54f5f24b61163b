"""Async client of the Tangram service (the verl integration and the demo use it).

One ``aiohttp.ClientSession`` per client; use it as an async context
manager (``close()`` is idempotent). Timeouts are keyword-only. Retries are
limited to what is safe: connection errors on idempotent requests (GET,
DELETE). A ``POST /v1/actions`` is never retried: the action may already be
running, and running it twice is worse than reporting the error.

    async with TangramClient("http://127.0.0.1:8471", token=...) as c:
        env = await c.create_environment(memory_mb=2048)
        r = await c.exec(env, "pytest -n ${parallel_num}", cpu={"min": 1, "max": 8}, profile="repo-x")
        print(r.status, r.timing.exec_s)
        await c.delete_environment(env)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp

_IDEMPOTENT = frozenset({"GET", "DELETE", "HEAD"})


class TangramHTTPError(Exception):
    """The service answered with an error status (or could not be reached: status 0)."""

    def __init__(self, status: int, message: str, field: str | None = None, body: Any = None):
        self.status = status
        self.message = message
        self.field = field
        self.body = body
        where = f" [{field}]" if field else ""
        super().__init__(f"HTTP {status}{where}: {message}")


@dataclass(slots=True)
class Timing:
    queued_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.queued_s + self.exec_s + self.overhead_s


@dataclass(slots=True)
class ActionResult:
    id: str
    status: str  # succeeded | failed | timeout | cancelled (or waiting | running from get_action)
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    output: Any = None
    error: str | None = None
    allocation: dict[str, Any] = field(default_factory=dict)
    timing: Timing | None = None

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed", "timeout", "cancelled")

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ActionResult":
        t = d.get("timing")
        return cls(
            id=d["id"], status=d["status"], exit_code=d.get("exit_code"), stdout=d.get("stdout"),
            stderr=d.get("stderr"), output=d.get("output"), error=d.get("error"),
            allocation=dict(d.get("allocation") or {}),
            timing=Timing(**{k: float(t.get(k, 0.0)) for k in ("queued_s", "exec_s", "overhead_s")}) if t else None,
        )


class TangramClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8471",
        *,
        token: str | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        retry_backoff_s: float = 0.2,
        max_connections: int = 0,
    ):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        # no total timeout by default: an action may legitimately queue for minutes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._retries = retries
        self._backoff = retry_backoff_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------- #

    def _sess(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
            )
        return self._session

    async def close(self) -> None:
        self._closed = True
        s, self._session = self._session, None
        if s is not None and not s.closed:
            await s.close()

    async def __aenter__(self) -> "TangramClient":
        self._sess()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- transport --------------------------------------------------------- #

    async def _request(self, method: str, path: str, *, json: Any = None, params: Mapping[str, str] | None = None,
                       timeout_s: float | None = None, expect: tuple[int, ...] = (200,)) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        attempts = 1 + (self._retries if method in _IDEMPOTENT else 0)
        for attempt in range(attempts):
            try:
                async with self._sess().request(method, self.base_url + path, json=json, params=params,
                                                timeout=timeout or self._timeout) as resp:
                    if resp.status == 204:
                        return None
                    if resp.status == 404 and attempt > 0 and method == "DELETE" and "environments" in path:
                        return None  # the try that lost its connection had deleted it
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        body = {"error": await resp.text()}
                    if resp.status not in expect:
                        msg = body.get("error") if isinstance(body, dict) else str(body)
                        raise TangramHTTPError(resp.status, msg or resp.reason or "error",
                                               body.get("field") if isinstance(body, dict) else None, body)
                    return body
            except (aiohttp.ClientConnectionError, ConnectionError) as exc:
                if attempt + 1 >= attempts:
                    raise TangramHTTPError(0, f"cannot reach {self.base_url}: {exc}") from exc
                await asyncio.sleep(self._backoff * (2 ** attempt))
        raise AssertionError("unreachable")

    # -- API ------------------------------------------------------------- #

    async def health(self, *, timeout_s: float | None = 10.0) -> dict[str, Any]:
        return await self._request("GET", "/healthz", timeout_s=timeout_s)

    async def stats(self, *, timeout_s: float | None = 30.0) -> dict[str, Any]:
        return await self._request("GET", "/v1/stats", timeout_s=timeout_s)

    async def create_environment(self, *, image: str | None = None, memory_mb: int | None = None,
                                 labels: Mapping[str, str] | None = None, timeout_s: float | None = None) -> str:
        body: dict[str, Any] = {}
        if image is not None:
            body["image"] = image
        if memory_mb is not None:
            body["memory_mb"] = memory_mb
        if labels is not None:
            body["labels"] = dict(labels)
        # not retried: a retried POST could create a second environment nobody deletes
        out = await self._request("POST", "/v1/environments", json=body, timeout_s=timeout_s, expect=(201,))
        return out["id"]

    async def delete_environment(self, env_id: str, *, timeout_s: float | None = None) -> None:
        await self._request("DELETE", f"/v1/environments/{env_id}", timeout_s=timeout_s, expect=(204,))

    async def run_action(self, action: Mapping[str, Any], *, timeout_s: float | None = None) -> ActionResult:
        """POST one action body and wait for its result (never retried)."""
        out = await self._request("POST", "/v1/actions", json=dict(action), timeout_s=timeout_s)
        return ActionResult.from_json(out)

    async def exec(self, environment: str | None, command: str, *, cpu: int | Mapping[str, int] | list[int] = 1,
                   profile: str | None = None, timeout_s: float | None = None, mem_mb: int | None = None,
                   env: Mapping[str, str] | None = None, request_timeout_s: float | None = None) -> ActionResult:
        """Run ``command`` in ``environment`` (None: a fresh one-shot environment)."""
        body: dict[str, Any] = {"kind": "exec", "command": command, "resources": {"cpu": cpu}}
        if environment is not None:
            body["environment"] = environment
        if profile is not None:
            body["profile"] = profile
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if mem_mb is not None:
            body["resources"]["mem_mb"] = mem_mb
        if env is not None:
            body["env"] = dict(env)
        return await self.run_action(body, timeout_s=request_timeout_s)

    async def submit(self, action: Mapping[str, Any], *, timeout_s: float | None = 30.0) -> str:
        """POST with ``wait=false``: returns the action id at once."""
        out = await self._request("POST", "/v1/actions", json=dict(action), params={"wait": "false"},
                                  timeout_s=timeout_s, expect=(202,))
        return out["id"]

    async def get_action(self, action_id: str, *, timeout_s: float | None = 30.0) -> ActionResult:
        return ActionResult.from_json(await self._request("GET", f"/v1/actions/{action_id}", timeout_s=timeout_s))

    async def cancel(self, action_id: str, *, timeout_s: float | None = 30.0) -> ActionResult:
        out = await self._request("DELETE", f"/v1/actions/{action_id}", timeout_s=timeout_s, expect=(200, 202))
        return ActionResult.from_json(out)

    async def wait(self, action_id: str, *, poll_s: float = 0.05, timeout_s: float | None = None) -> ActionResult:
        """Poll a submitted action until it finishes."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            r = await self.get_action(action_id)
            if r.finished:
                return r
            if deadline is not None and loop.time() >= deadline:
                raise asyncio.TimeoutError(f"action {action_id} still {r.status} after {timeout_s} s")
            await asyncio.sleep(poll_s)
