"""``POST /sandbox/{key}/run_code``: SandboxFusion's ``run_code`` API over the scheduler.

Each call is one ``exec`` action in a fresh one-shot environment (``cpu`` 1 by
default, ``mem_mb`` = ``memory_limit_MB`` plus the runner's own share), queued,
scheduled and accounted like every other action (class
``sandbox_fusion.<language>`` in ``/v1/stats``, kind ``exec`` in ``/metrics``).
The action runs :mod:`tangram.service.sandbox_runner` with the request on its
stdin; the runner writes the files, compiles and runs under separate timeouts and
reports SandboxFusion's result, which :mod:`tangram.service.sandbox_protocol` maps
to the response.

Authentication: clients such as verl send no headers, and log the URL. The
endpoint therefore takes its own narrowly scoped key as a path segment
(``/sandbox/<key>/run_code``, compared in constant time), never the admin
token; the key opens this route only. Without a key the route is
``/sandbox/run_code`` when the service has no token, and absent (404) when it has
one. Nothing here logs the request path.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import shlex
from pathlib import Path
from typing import Any

from aiohttp import web

from tangram.core.errors import DemandError
from tangram.service import sandbox_protocol as proto
from tangram.service import sandbox_runner
from tangram.service.admission import Refused, job_of
from tangram.service.keys import CONFIG_KEY, GATE_KEY, RUNTIME_KEY, WAITERS_KEY
from tangram.service.sandbox_protocol import SandboxFusionConfig

log = logging.getLogger("tangram.service.sandbox_fusion")

PREFIX = "/sandbox/"
# the action's own bound on top of compile_timeout + run_timeout: interpreter start, file writes, fetches
ACTION_GRACE_S = 10.0
# memory the runner itself holds besides the program: its interpreter (~10 MiB RSS); plus, per call,
# four times the output cap (two capped streams, and their copies while the report is written)
RUNNER_MEM_MB = 16
FIELD_OF_RESOURCE = {"resources.mem_mb": "memory_limit_MB", "mem_mb": "memory_limit_MB"}


class SandboxFusionEndpoint:
    """The route's state: which languages can run here, the runner's command line."""

    def __init__(self, cfg: SandboxFusionConfig):
        self.cfg = cfg
        self.languages: dict[str, proto.Language] = {}
        self.unavailable: dict[str, str] = {}
        for name, lang in cfg.languages.items():
            why = proto.missing_tool(lang)
            if why is None:
                self.languages[name] = lang
            else:
                self.unavailable[name] = why
                log.warning("sandbox_fusion: language %s disabled: %s", name, why)
        source = Path(sandbox_runner.__file__).read_text()
        # one string shared by every action (kept with finished results, so not copied per call)
        self.command = f"exec {shlex.quote(cfg.runner_python)} -I -S -c {shlex.quote(source)}"

    async def run_code(self, request: web.Request) -> web.Response:
        rt = request.app[RUNTIME_KEY]
        received = rt.clock()
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            req = proto.parse_run_code(body, self.languages)
        except DemandError as exc:
            lang = body.get("language") if isinstance(body, dict) else None
            if exc.field == "language" and isinstance(lang, str) and lang in self.unavailable:
                return _invalid("language", f"{lang!r} is disabled on this service: {self.unavailable[lang]}")
            return _invalid(exc.field, exc.reason)
        lang = self.languages[req.language]
        # a bytearray, emptied once the action ended: the finished result keeps its action, not the input
        nonce = secrets.token_hex(16)  # the runner's report must carry it: the program cannot forge one
        stdin = proto.encode_request(req, lang, max_output_bytes=self.cfg.max_output_bytes, nonce=nonce)
        resources: dict[str, Any] = {"cpu": self.cfg.cpu}
        if req.memory_limit_mb > 0:
            resources["mem_mb"] = req.memory_limit_mb + RUNNER_MEM_MB + 4 * -(-self.cfg.max_output_bytes >> 20)
        try:
            action = rt.build_action("exec", resources, command=self.command,
                                     timeout_s=req.compile_timeout + req.run_timeout + ACTION_GRACE_S,
                                     action_class=f"sandbox_fusion.{req.language}", payload={"stdin": stdin})
            # admitted like every action: bounded per job (X-Tangram-Job, else the caller's address) and in total
            gate = request.app[GATE_KEY]
            action_id = gate.offer(job_of(request.headers, lambda: request.remote), action, received)
        except DemandError as exc:  # e.g. more memory than any node has: 422 at once, never queued
            return _invalid(FIELD_OF_RESOURCE.get(exc.field, exc.field), exc.reason)
        except Refused as exc:  # 504, which SandboxFusion clients (verl) retry after a pause; 429/503 they do not
            return web.json_response({"error": exc.reason, "status": exc.status}, status=504,
                                     headers={"Retry-After": str(exc.retry_after_s)})
        waiters = request.app[WAITERS_KEY]
        waiters[action_id] = request  # a client that hangs up cancels its action
        try:
            try:
                await gate.submitted(action_id)  # held for its job's turn
            except asyncio.CancelledError:
                if gate.cancelled_outcome(action_id) is not None:  # ended held (the service stops): say so
                    return _stopping()
                gate.drop(action_id)  # held, or handed to the engine as its client went
                raise
            except DemandError as exc:  # refused by the engine when its turn came
                return _invalid(FIELD_OF_RESOURCE.get(exc.field, exc.field), exc.reason)
            outcome = await rt.wait(action_id)
        finally:
            waiters.pop(action_id, None)
            stdin.clear()
        if outcome.status == "cancelled" and gate.closing:  # a run the shutdown ended
            return _stopping()
        answer = response_of(outcome, nonce)
        outcome.stdout = outcome.stderr = None  # nobody can ask for it again (its id is never given out): free it
        return web.json_response(answer)

    async def _body(self, request: web.Request) -> Any:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _too_large(limit)
        raw = bytearray()

        async def read() -> bool:
            async for chunk in request.content.iter_chunked(1 << 16):
                raw.extend(chunk)
                if len(raw) > limit:
                    return False
            return True

        try:  # a sender that stalls mid-body gets 408, as on every route
            if not await asyncio.wait_for(read(), request.app[CONFIG_KEY].service.body_timeout_s):
                return _too_large(limit)
        except asyncio.TimeoutError:
            return web.json_response({"error": "request body not received in time", "field": "body"}, status=408)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _invalid("body", f"malformed JSON: {exc}")
        except RecursionError:
            return _invalid("body", "JSON nested too deeply")


def _stopping() -> web.Response:
    """A call the service's shutdown ended: 504 with Retry-After, which SandboxFusion clients (verl) retry."""
    return web.json_response({"error": "the service is stopping", "status": 503}, status=504,
                             headers={"Retry-After": "5"})


def response_of(outcome: Any, nonce: str) -> dict[str, Any]:
    """The RunCodeResponse of a finished action (SandboxError unless the runner reported)."""
    if outcome.status == "succeeded":
        report = proto.decode_report(outcome.stdout or "", nonce)
        if report is not None:
            return proto.response_from_report(report)
        return proto.sandbox_error("the sandbox runner's report is missing or cut short")
    if outcome.status == "timeout":
        return proto.sandbox_error(f"the sandbox did not finish within compile_timeout + run_timeout + "
                                   f"{ACTION_GRACE_S:g} s")
    if outcome.status == "cancelled":
        return proto.sandbox_error(f"cancelled: {outcome.error or 'the service is shutting down'}")
    detail = (outcome.stderr or "").strip()[-2000:]
    return proto.sandbox_error(f"the sandbox runner failed ({outcome.error or outcome.status})"
                               + (f": {detail}" if detail else ""))


def _invalid(field_name: str, reason: str) -> web.Response:
    return web.json_response(proto.validation_error(field_name, reason), status=422)


def _too_large(limit: int) -> web.Response:
    return web.json_response({"error": f"request body too large (limit {limit} bytes)", "field": "body"},
                             status=413)


def register(app: web.Application, cfg: SandboxFusionConfig, *, token: str | None) -> None:
    """Add the route: ``/sandbox/{key}/run_code`` with a key, ``/sandbox/run_code`` with neither key nor token."""
    if cfg.key is None and token is not None:
        return  # the admin token never goes into a URL: no key, no route (404)
    endpoint = SandboxFusionEndpoint(cfg)
    log.info("SandboxFusion-compatible endpoint: POST %s (languages: %s)",
             PREFIX + ("<key>/" if cfg.key else "") + "run_code", ", ".join(sorted(endpoint.languages)) or "none")
    if cfg.key is None:
        app.router.add_post(PREFIX + "run_code", endpoint.run_code)
        return
    expected = cfg.key.encode()

    async def keyed(request: web.Request) -> web.Response:
        given = request.match_info["key"].encode()
        if not hmac.compare_digest(given, expected):  # constant time; same answer as a route that is not there
            return web.json_response({"error": "Not Found"}, status=404)
        try:
            return await endpoint.run_code(request)
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception:  # noqa: BLE001 - a bug: logged here without the path, which holds the key
            log.exception("POST /sandbox/<key>/run_code failed")
            return web.json_response({"error": "internal error (see the service log)"}, status=500)

    app.router.add_post(PREFIX + "{key}/run_code", keyed)
