"""Async client of the Tangram service (the verl integration and the demo use it).

One ``aiohttp.ClientSession`` per client; use it as an async context
manager (``close()`` is idempotent). Timeouts are keyword-only; ``timeout_s``
is the client's deadline for one request (``None``: none), a per-call
``timeout_s`` overrides it, and a request that runs past it raises
:class:`TangramHTTPError` with status 0 and ``timed_out`` set. Retries are
limited to what is safe: connection errors on idempotent requests (GET,
DELETE, HEAD), and on any request when the connection could not even be opened
(nothing was sent). A ``POST /v1/actions`` whose request went out is never
retried: the action may already be running, and running it twice is worse
than reporting the error; one sent with an ``idempotency_key`` is retried on a
lost connection, since the service runs one action per key.

A request the service *refused for now* (``429`` or ``503`` with a
``Retry-After`` header: its admission control, a node that is down; the
service did nothing) is tried again after that many seconds (jittered, so that
many waiting clients do not come back at once) for up to ``admission_wait_s``
in all, 0 by default: raise at once. A client that sends more actions than the
service queues (a rollout of thousands of trajectories) sets it to wait
instead of failing (the verl integration does); the error, once the wait is
spent, carries ``retry_after_s``. The time spent so is counted per client
(``admission_waits``, ``admission_waited_s``) and per result of
``run_action`` / ``exec`` (``ActionResult.admission_wait_s``; a ``submit``'s
only in the counters). ``job`` names the client's job
(``X-Tangram-Job``), which the service's caps and fair share count by; without
it, the client's address is its job.

The token is ``token``, else the contents of ``token_file``, else the
``TANGRAM_TOKEN`` environment variable, else the file named by
``TANGRAM_TOKEN_FILE``, else ``~/.config/tangram/token`` when it exists
(:func:`resolve_token`); it is never part of a repr or an error message.

    async with TangramClient("http://127.0.0.1:8471", token=...) as c:
        env = await c.create_environment(memory_mb=2048)
        r = await c.exec(env, "pytest -n ${parallel_num}", cpu={"min": 1, "max": 8}, profile="repo-x")
        print(r.status, r.timing.exec_s)
        await c.delete_environment(env)
"""
from __future__ import annotations

import asyncio
import email.utils
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp

_IDEMPOTENT = frozenset({"GET", "DELETE", "HEAD"})
_REFUSED_FOR_NOW = frozenset({429, 503})  # with Retry-After: the service did nothing, come back then
_RETRY_AFTER_MAX_S = 300.0  # a longer Retry-After is waited for this long, then asked again


DEFAULT_TOKEN_FILE = "~/.config/tangram/token"  # where `tangram serve` writes one when none is configured


def resolve_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str | None:
    """The bearer token: ``token``, else ``token_file``'s contents, else ``$TANGRAM_TOKEN``, else the
    contents of ``$TANGRAM_TOKEN_FILE``, else of ``~/.config/tangram/token`` if it exists (the file
    ``tangram serve`` writes); None if there is none. A named file that is unreadable or empty raises."""
    if token:
        return token
    if not token_file and os.environ.get("TANGRAM_TOKEN"):
        return os.environ["TANGRAM_TOKEN"].strip()
    path = token_file or os.environ.get("TANGRAM_TOKEN_FILE")
    if not path:
        default = os.path.expanduser(DEFAULT_TOKEN_FILE)
        if not os.path.exists(default):
            return None
        path = default
    path = os.path.expanduser(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ValueError(f"token file {path!r} cannot be read: {exc.strerror or exc}") from None
    if not value:
        raise ValueError(f"token file {path!r} is empty")
    return value


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds from now (RFC 9110: delay-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None or when.tzinfo is None:
            return None
        try:
            seconds = when.timestamp() - time.time()
        except (OverflowError, ValueError, OSError):  # a date beyond what the platform represents
            return None
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


class TangramHTTPError(Exception):
    """The service answered with an error status (or could not be reached / did not answer in time: status 0)."""

    def __init__(self, status: int, message: str, field: str | None = None, body: Any = None, *,
                 timed_out: bool = False, retry_after_s: float | None = None, never_sent: bool = False):
        self.status = status
        self.message = message
        self.field = field
        self.body = body
        self.timed_out = timed_out
        self.never_sent = never_sent  # the connection could not be opened: the service saw nothing
        self.retry_after_s = retry_after_s  # the service's Retry-After: refused for now, not for good
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
    # seconds this client waited, before the service took the action, because it refused it for now
    # (its queues were full): not part of the service's timing, which starts once it takes the action
    admission_wait_s: float = 0.0
    truncated: bool = False  # the executor dropped output past its cap (it keeps the start)

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
            truncated=bool(d.get("truncated")),
        )


class TangramClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8471",
        *,
        token: str | None = None,
        token_file: str | os.PathLike | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        retry_backoff_s: float = 0.2,
        max_connections: int = 0,
        admission_wait_s: float = 0.0,
        job: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        token = resolve_token(token, token_file)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if job is not None:  # the service's admission caps and fair share count per job (else per address)
            if not isinstance(job, str) or not job or len(job) > 128 or not (job.isascii() and job.isprintable()):
                raise ValueError(f"job: must be 1 to 128 printable ASCII characters, got {job!r}")
            self._headers["X-Tangram-Job"] = job
        # no total timeout by default: an action may legitimately queue for minutes
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._retries = retries
        self._backoff = retry_backoff_s
        if not admission_wait_s >= 0:
            raise ValueError(f"admission_wait_s must be >= 0, got {admission_wait_s!r}")
        self._admission_wait_s = float(admission_wait_s)
        self.admission_waits = 0  # refusals for now waited on (counted once each wait ended)
        self.admission_waited_s = 0.0  # seconds spent waiting so
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------- #

    def __repr__(self) -> str:  # never the token
        return f"TangramClient({self.base_url!r})"

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
        return (await self._request_waited(method, path, json=json, params=params, timeout_s=timeout_s,
                                           expect=expect))[0]

    async def _request_waited(self, method: str, path: str, *, json: Any = None,
                              params: Mapping[str, str] | None = None, timeout_s: float | None = None,
                              expect: tuple[int, ...] = (200,),
                              headers: Mapping[str, str] | None = None) -> tuple[Any, float]:
        """The answer's body, and the seconds spent waiting on refusals for now (admission_wait_s)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeout.sock_connect) \
            if timeout_s is not None else self._timeout
        # a POST under an Idempotency-Key is one action however often it is sent: the service answers a
        # resubmission with the first one's result
        idempotent = method in _IDEMPOTENT or "Idempotency-Key" in (headers or {})
        attempt = 0
        waited = 0.0
        while True:
            pause = None
            try:
                async with self._sess().request(method, self.base_url + path, json=json, params=params,
                                                timeout=timeout, headers=headers) as resp:
                    if resp.status == 204:
                        return None, waited
                    if resp.status == 404 and attempt > 0 and method == "DELETE" and "environments" in path:
                        return None, waited  # the try that lost its connection had deleted it
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        body = {"error": await resp.text()}
                    if resp.status in expect:
                        return body, waited
                    msg = body.get("error") if isinstance(body, dict) else str(body)
                    retry_after = (retry_after_s(resp.headers.get("Retry-After"))
                                   if resp.status in _REFUSED_FOR_NOW else None)
                    pause = self._admission_pause(retry_after, waited)
                    if pause is None:
                        raise TangramHTTPError(resp.status, msg or resp.reason or "error",
                                               body.get("field") if isinstance(body, dict) else None, body,
                                               retry_after_s=retry_after)
            except asyncio.TimeoutError as exc:
                # the deadline of this request: the service is stalled (or the action queued too long)
                if method not in _IDEMPOTENT or attempt >= self._retries:  # a deadline is the caller's bound
                    raise TangramHTTPError(0, f"no answer from {self.base_url} to {method} {path} within "
                                              f"{timeout.total or timeout.sock_connect} s", timed_out=True) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
                # a connection that could not be opened sent nothing: safe to retry any request; an answer cut
                # off mid-body (ClientPayloadError) is a connection lost after sending
                never_sent = isinstance(exc, aiohttp.ClientConnectorError)
                if not (idempotent or never_sent) or attempt >= self._retries:
                    raise TangramHTTPError(0, f"cannot reach {self.base_url}: {exc}", never_sent=never_sent) from exc
            if pause is not None:  # refused for now (the connection is back in the pool meanwhile)
                t0 = time.monotonic()
                try:
                    await asyncio.sleep(pause)
                finally:  # a cancelled wait counts too: the two counters move together
                    slept = time.monotonic() - t0
                    waited += slept
                    self.admission_waits += 1
                    self.admission_waited_s += slept
                if self._closed:
                    raise TangramHTTPError(0, f"the client was closed while {method} {path} waited to be "
                                              "sent again (the service had refused it for now)")
                continue
            await asyncio.sleep(self._backoff * (2 ** attempt))
            attempt += 1

    def _admission_pause(self, retry_after: float | None, waited: float) -> float | None:
        """How long to wait before asking again after a refusal for now; None: raise it."""
        left = self._admission_wait_s - waited
        if retry_after is None or left <= 0:
            return None
        # jittered upwards: clients refused together do not all come back in the same instant
        pause = max(0.1, min(retry_after, _RETRY_AFTER_MAX_S)) * random.uniform(1.0, 1.5)
        return min(pause, left)

    # -- API ------------------------------------------------------------- #

    async def health(self, *, timeout_s: float | None = 10.0) -> dict[str, Any]:
        return await self._request("GET", "/healthz", timeout_s=timeout_s)

    async def stats(self, *, timeout_s: float | None = 30.0) -> dict[str, Any]:
        return await self._request("GET", "/v1/stats", timeout_s=timeout_s)

    async def create_environment(self, *, image: str | None = None, memory_mb: int | None = None,
                                 labels: Mapping[str, str] | None = None, timeout_s: float | None = None,
                                 trajectory: str | None = None) -> str:
        """``trajectory``: the name the rollout's http and model actions gave before it had this
        environment; the service counts those, and later ones naming it, as the environment's."""
        body: dict[str, Any] = {}
        if trajectory is not None:
            body["trajectory"] = trajectory
        if image is not None:
            body["image"] = image
        if memory_mb is not None:
            body["memory_mb"] = memory_mb
        if labels is not None:
            body["labels"] = dict(labels)
        # not retried once sent (a second environment nobody deletes), but for a refusal for now, which
        # created nothing (admission_wait_s)
        out = await self._request("POST", "/v1/environments", json=body, timeout_s=timeout_s, expect=(201,))
        return out["id"]

    async def delete_environment(self, env_id: str, *, timeout_s: float | None = None) -> None:
        await self._request("DELETE", f"/v1/environments/{env_id}", timeout_s=timeout_s, expect=(204,))

    async def run_action(self, action: Mapping[str, Any], *, timeout_s: float | None = None,
                         idempotency_key: str | None = None) -> ActionResult:
        """POST one action body and wait for its result (never sent twice once the service may have taken
        it; a refusal for now is waited on, see ``admission_wait_s``). With ``idempotency_key`` (1-256
        visible ASCII characters) it may be sent again, by this client or its caller: the service runs
        one action per key and answers every resubmission with that action's result."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        out, waited = await self._request_waited("POST", "/v1/actions", json=dict(action), timeout_s=timeout_s,
                                                 headers=headers)
        result = ActionResult.from_json(out)
        result.admission_wait_s = waited
        return result

    async def exec(self, environment: str | None, command: str, *, cpu: int | Mapping[str, int] | list[int] = 1,
                   profile: str | None = None, timeout_s: float | None = None, mem_mb: int | None = None,
                   env: Mapping[str, str] | None = None, request_timeout_s: float | None = None,
                   restartable: bool = False, idempotency_key: str | None = None,
                   stdin: str | None = None) -> ActionResult:
        """Run ``command`` in ``environment`` (None: a fresh one-shot environment). ``restartable``: the
        service may stop a straggling run and start it again at a wider DoP (a test suite's reward).
        ``stdin``: fed to the command (as UTF-8), then EOF; None: no input. Text too long for ``env``
        (32 KiB a value) goes here."""
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
        if restartable:
            body["restartable"] = True
        if stdin is not None:
            body["stdin"] = stdin
        return await self.run_action(body, timeout_s=request_timeout_s, idempotency_key=idempotency_key)

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
