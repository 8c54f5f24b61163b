"""The aiohttp service: the wire API over one :class:`~tangram.runtime.Runtime`.

``create_app(config)`` builds the application; the runtime (engine,
managers, executors) is created and closed by a ``cleanup_ctx`` so it lives
exactly as long as the app, on the app's loop. Handlers are thin: parse and
validate the body (:mod:`tangram.service.wire`), call the runtime, map
errors to ``{"error", "field"}`` with the right status.

A client that disconnects while waiting for its action cancels the action:
aiohttp cancels the handler when ``handler_cancellation`` is on (as
``tangram serve`` runs it) and, whatever the runner's settings, a watcher
checks the transports of waiting requests a few times a second. An action sent
with an ``Idempotency-Key`` and a ``timeout_s`` is not cancelled so: it runs on,
bounded by its timeout, and a resubmission with the key (after a lost answer)
collects its result.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import sqlite3
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from tangram.core.errors import DemandError, UnavailableError, UnknownActionError, UnschedulableError
from tangram.runtime import ExecutorFailedError, ExecutorMissingError, Runtime, UnknownEnvironmentError
from tangram.runtime.environments import quietly
from tangram.service import sandbox_fusion, wire
from tangram.service.config import ClusterConfig, default_config
from tangram.service.admission import FairGate, Refused, job_of
from tangram.service.edge import GuardedSite, HeadDeadline, disarm_on_request, tls_context
from tangram.service.recover import durable_config, reaper, reconcile
from tangram.service.state import StateError, StateStore
from tangram.service.keys import (  # noqa: F401
    CONFIG_KEY, DEADLINE_KEY, GATE_KEY, METRICS_KEY, RUNTIME_KEY, WAITERS_KEY)
from tangram.service.metrics import ServiceMetrics

log = logging.getLogger("tangram.service")

RuntimeFactory = Callable[[ClusterConfig], "Runtime | Awaitable[Runtime]"]

STATE_KEY = web.AppKey("state", StateStore)
DISCONNECT_POLL_S = 0.25
CANCEL_WAIT_S = 10.0
PUBLIC_PATHS = frozenset({"/healthz"})


def create_app(config: ClusterConfig | None = None, *, runtime_factory: RuntimeFactory | None = None) -> web.Application:
    """The service for ``config`` (the embedded default when None)."""
    config = durable_config(config or default_config())
    deadline = HeadDeadline(config.service.header_timeout_s)
    app = web.Application(
        client_max_size=config.service.max_body_bytes,
        middlewares=[disarm_on_request(deadline), _error_middleware, _auth_middleware(config.service.token)],
    )
    app[CONFIG_KEY] = config
    app[DEADLINE_KEY] = deadline
    app[WAITERS_KEY] = {}
    app.cleanup_ctx.append(_runtime_ctx(runtime_factory))
    app.cleanup_ctx.append(_disconnect_watcher)
    app.on_shutdown.append(_cancel_in_flight)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/environments", create_environment)
    app.router.add_get("/v1/environments", list_environments)
    app.router.add_get("/v1/environments/{id}", get_environment)
    app.router.add_post("/v1/environments/{id}/renew", renew_environment)
    app.router.add_delete("/v1/environments/{id}", delete_environment)
    app.router.add_post("/v1/actions", post_action)
    app.router.add_get("/v1/actions/{id}", get_action)
    app.router.add_delete("/v1/actions/{id}", cancel_action)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/metrics", metrics)
    sandbox_fusion.register(app, config.sandbox_fusion, token=config.service.token)
    return app


def _runtime_ctx(factory: RuntimeFactory | None):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        cfg = app[CONFIG_KEY]
        try:
            store = StateStore(cfg.service.state_dir, keep_results=cfg.service.keep_results)
        except (StateError, OSError) as exc:
            from tangram.service.config import ConfigError

            raise ConfigError("service.state_dir", str(exc)) from None
        app[STATE_KEY] = store
        runtime = None
        try:  # a failed start releases what it took: the state's lock, the runtime, the metrics callback
            if factory is None:
                from tangram.service.build import build_runtime

                runtime = await build_runtime(app[CONFIG_KEY])
            else:
                made = factory(app[CONFIG_KEY])
                runtime = await made if inspect.isawaitable(made) else made
            app[RUNTIME_KEY] = runtime
            app[METRICS_KEY] = ServiceMetrics(runtime)
            await reconcile(store, runtime)
        except BaseException:
            try:
                if METRICS_KEY in app:
                    app[METRICS_KEY].close()
                if runtime is not None:  # its own failure logged: the start's error is the answer
                    await quietly(runtime.close(), "closing the runtime of a failed start")
            finally:
                store.close()
            raise
        runtime.listeners += [lambda job, outcome: store.finish_action(job.action.id, outcome.as_dict()), wire.free_input]
        reap = (asyncio.get_running_loop().create_task(reaper(store, runtime, cfg.service.env_ttl_s))
                if cfg.service.env_ttl_s > 0 else None)
        # the engine sees enough waiting actions for its look-ahead; the rest wait here, fairly
        app[GATE_KEY] = FairGate(runtime, max_total=cfg.service.max_queued_total,
                                 max_per_job=cfg.service.max_queued_per_job,
                                 window=cfg.service.engine_window or max(64, 4 * cfg.lookahead),
                                 on_finished=store.finish_action)
        app[METRICS_KEY].watch_gate(app[GATE_KEY])
        try:
            yield
        finally:
            if reap is not None:
                reap.cancel()
            try:
                await app[GATE_KEY].close()
                await runtime.close()
                store.close()
            finally:
                app[METRICS_KEY].close()  # the process's collection callback, whatever failed above

    return ctx


async def _cancel_in_flight(app: web.Application) -> None:
    """On shutdown, before aiohttp waits for open handlers: cancel every action (killing its work),
    so waiting clients get a ``cancelled`` result at once instead of a dropped connection later."""
    gate, runtime = app.get(GATE_KEY), app.get(RUNTIME_KEY)
    if gate is not None:
        # first: held actions are cancelled (and stored so), not handed to a closed runtime meanwhile
        await gate.close()
    if runtime is not None:
        await runtime.close()  # idempotent: the cleanup context closes it again


async def _disconnect_watcher(app: web.Application) -> AsyncIterator[None]:
    """Cancel the actions of clients that went away (whatever the runner's handler_cancellation)."""

    async def watch() -> None:
        waiters: dict[str, web.Request] = app[WAITERS_KEY]
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            gone = [aid for aid, req in waiters.items() if req.transport is None or req.transport.is_closing()]
            for aid in gone:
                waiters.pop(aid, None)
                app[GATE_KEY].drop(aid)

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


# ---------------------------------------------------------------------------- #
# middlewares


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Refused as exc:
        return web.json_response({"error": exc.reason}, status=exc.status,
                                 headers={"Retry-After": str(exc.retry_after_s)})
    except UnavailableError as exc:  # not now: its node is down and may come back
        return web.json_response({"error": exc.reason, "field": exc.field}, status=503,
                                 headers={"Retry-After": str(exc.retry_after_s)})
    except UnschedulableError as exc:
        return _error(422, exc.reason, exc.field)
    except ExecutorMissingError as exc:
        return _error(422, exc.reason, exc.field)
    except DemandError as exc:
        return _error(400, exc.reason, exc.field)
    except (UnknownEnvironmentError, UnknownActionError) as exc:
        return _error(404, str(exc))
    except ExecutorFailedError as exc:  # the node's engine (Docker, ...) failed: not the caller's fault
        log.warning("%s %s: %s", request.method, request.path, exc)
        return _error(502, str(exc))
    except web.HTTPRequestEntityTooLarge:  # aiohttp keeps no max_size on it: the configured limit is the one
        return _error(413, f"request body too large: at most {request.app[CONFIG_KEY].service.max_body_bytes} "
                      "bytes (service.max_body_bytes)", "body")
    except web.HTTPRequestTimeout as exc:
        return _error(408, exc.reason, "body")
    except web.HTTPMethodNotAllowed as exc:  # RFC 9110: a 405 lists the methods the route allows
        allowed = sorted(exc.allowed_methods)
        resp = _error(405, f"method {exc.method} is not allowed here (allowed: {', '.join(allowed)})", "method")
        resp.headers["Allow"] = ", ".join(allowed)
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except Exception:  # noqa: BLE001 - a bug: log it, answer 500, keep serving
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal error (see the service log)")


def _auth_middleware(token: str | None):
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        # /sandbox/ routes check their own narrowly scoped key (clients there send no headers)
        if expected is not None and request.path not in PUBLIC_PATHS and not request.path.startswith(
                sandbox_fusion.PREFIX):
            # aiohttp keeps undecodable header bytes as surrogates: encode them back, never fail
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):  # constant time
                return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return auth


async def _json_body(request: web.Request, *, optional: bool = False) -> Any:
    limit = request.app[CONFIG_KEY].service.max_body_bytes
    if request.content_length is not None and request.content_length > limit:  # refused before it is sent
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:  # raises 413 past client_max_size; a sender that stalls mid-body gets 408
        raw = await asyncio.wait_for(request.read(), request.app[CONFIG_KEY].service.body_timeout_s)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(reason="request body not received in time") from None
    if not raw.strip():
        if optional:
            return {}  # no body at all: every field takes its default (a JSON null is refused)
        raise DemandError("body", "a JSON object is required")
    try:
        return json.loads(raw)
    except RecursionError:
        raise DemandError("body", f"JSON nested too deep (at most {wire.LIMITS['depth']} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DemandError("body", f"malformed JSON: {exc}") from None


# ---------------------------------------------------------------------------- #
# handlers


async def healthz(request: web.Request) -> web.Response:
    rt = request.app.get(RUNTIME_KEY)
    # how each CPU node confines commands: sandbox | none (local), container (docker)
    executors = (rt.env_executors if rt else {}).items()
    isolation = {node: getattr(ex, "sandbox", None) or "container" for node, ex in executors}
    # what finds an action's processes for its kill: sandbox, cgroup, pid_namespace[_host_proc], token, container
    tracking = {node: getattr(ex, "process_tracking", "container") for node, ex in executors}
    return web.json_response({"status": "ok", "running": len(rt.engine.running) if rt else 0,
                              "queue_length": len(rt.engine.waiting) if rt else 0, "isolation": isolation,
                              "process_tracking": tracking})


async def create_environment(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    kwargs = wire.parse_environment(await _json_body(request, optional=True))
    named = kwargs.pop("trajectory", None)  # the rollout's calls named it so before: from now on, this one
    # the executors as built (``executor: auto`` resolved): never a registry pull of a name a caller chose
    if (why := rt.env_registry.refusal(kwargs.get("image"), bool(kwargs.get("network")))) is not None:
        raise UnschedulableError(*why)
    cap = request.app[CONFIG_KEY].service.max_environments
    if len(rt.environments()) >= cap:  # nothing made; room comes as environments are deleted or reclaimed
        raise Refused(503, f"the service holds {cap} environments (service.max_environments); delete ones "
                           "no longer needed", 5)
    env_id = await rt.create_environment(**kwargs)
    if named is not None:
        rt.loose.adopt(named, env_id)
    nodes = list(rt.env_executors)
    try:  # recorded before the caller hears of it: a crash from here on cannot lose it
        request.app[STATE_KEY].record_environment(env_id, image=kwargs.get("image"), memory_mb=kwargs.get("memory_mb", 0),
                                                  labels=kwargs.get("labels", {}),
                                                  node=nodes[0] if len(nodes) == 1 else rt.engine.placement.get(env_id),
                                                  network=kwargs.get("network", False))
    except BaseException:
        await quietly(rt.delete_environment(env_id), f"removing environment {env_id} after its record failed")
        raise
    return web.json_response({"id": env_id}, status=201)


def _env_view(request: web.Request, env) -> dict:
    return {"id": env.id, "image": env.image, "memory_mb": env.memory_mb, "labels": env.labels,
            "node": request.app[RUNTIME_KEY].engine.placement.get(env.id), "active_actions": len(env.active),
            "last_used": request.app[STATE_KEY].last_used(env.id)}


async def list_environments(request: web.Request) -> web.Response:
    envs = request.app[RUNTIME_KEY].environments()
    return web.json_response({"environments": [_env_view(request, e) for e in envs],
                              "ttl_s": request.app[CONFIG_KEY].service.env_ttl_s})


async def renew_environment(request: web.Request) -> web.Response:
    """Renew an environment's lease (any action in it renews it too)."""
    env = request.app[RUNTIME_KEY].environment(request.match_info["id"])
    request.app[STATE_KEY].touch_environment(env.id)
    return web.json_response(_env_view(request, env))


async def get_environment(request: web.Request) -> web.Response:
    return web.json_response(_env_view(request, request.app[RUNTIME_KEY].environment(request.match_info["id"])))


async def delete_environment(request: web.Request) -> web.Response:
    rt, env_id, store = request.app[RUNTIME_KEY], request.match_info["id"], request.app[STATE_KEY]

    async def delete() -> None:
        await rt.delete_environment(env_id)
        store.drop_environment(env_id)  # in the shielded part too: a hang-up once left its row behind

    # shielded: a client hanging up mid-delete must not leave a half-removed environment
    await asyncio.shield(delete())
    return web.Response(status=204)


async def post_action(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    received = rt.clock()
    wait = _flag(request.query.get("wait", "true"), "wait")
    key = _idempotency_key(request)
    kwargs = wire.parse_action(await _json_body(request))
    kept = key is not None and kwargs.get("timeout_s") is not None  # bounded: it may outlive its client
    store = request.app[STATE_KEY]
    if key is not None and (seen := store.action_for_key(key)) is not None:
        return await _answer_existing(request, seen, wait, kept)  # a resubmission: never run twice
    action = rt.build_action(**kwargs)
    gate = request.app[GATE_KEY]
    job = job_of(request.headers, lambda: request.remote)
    gate.check(job)  # a refusal for now writes nothing (clients come back every second or so)
    try:
        store.record_action(action.id, idem_key=key, environment=kwargs.get("environment"))
    except sqlite3.IntegrityError:  # the same key raced in: answer that one
        return await _answer_existing(request, store.action_for_key(key), wait, kept)
    try:
        action_id = gate.offer(job, action, received)  # no await since the check: the same answer
    except BaseException:
        store.forget_action(action.id)
        raise
    if kwargs.get("environment"):
        store.touch_environment(kwargs["environment"])
    if not wait:
        return web.json_response({"id": action_id, "status": gate.held_state(action_id) or rt.state(action_id)},
                                 status=202)
    return await _wait_for(request, action_id, kept)


def _idempotency_key(request: web.Request) -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    # the Idempotency-Key draft's string: visible ASCII and spaces (HTTP drops spaces at either end)
    if not key or len(key) > 256 or not all(" " <= c <= "~" for c in key):
        raise DemandError("Idempotency-Key", "must be 1 to 256 visible ASCII characters or spaces")
    return key


async def _answer_existing(request: web.Request, action_id: str, wait: bool, kept: bool) -> web.Response:
    rt, gate = request.app[RUNTIME_KEY], request.app[GATE_KEY]
    try:
        rt.result(action_id)  # raises for an id this runtime never saw or has forgotten
        known = True
    except UnknownActionError:
        known = gate.held_state(action_id) is not None
    if not known:  # from before a restart, or long finished
        return _stored(request, action_id)
    if not wait:
        outcome = rt.result(action_id) if gate.held_state(action_id) is None else None
        if outcome is not None:
            return web.json_response(outcome.as_dict())
        return web.json_response({"id": action_id, "status": gate.held_state(action_id) or rt.state(action_id)},
                                 status=202)
    return await _wait_for(request, action_id, kept)


def _stored(request: web.Request, action_id: str) -> web.Response:
    rec = request.app[STATE_KEY].action(action_id)
    if rec is None:
        return _error(404, f"action {action_id!r} is unknown")
    status, outcome = rec
    if outcome is None:
        return _error(410, f"action {action_id!r} finished long ago; its result is no longer kept "
                           f"(service.keep_results)")
    return web.json_response(outcome)


async def _wait_for(request: web.Request, action_id: str, kept: bool = False) -> web.Response:
    """The action's outcome once it ends. ``kept``: sent under an Idempotency-Key with a timeout_s, it
    outlives its client (a resubmission with the key collects it), its timeout the bound."""
    rt, gate = request.app[RUNTIME_KEY], request.app[GATE_KEY]
    waiters = request.app[WAITERS_KEY]
    if not kept:
        waiters[action_id] = request
    try:
        try:
            await gate.submitted(action_id)  # held for its job's turn
        except asyncio.CancelledError:
            if (cancelled := gate.cancelled_outcome(action_id)) is not None:
                return web.json_response(cancelled)  # cancelled by DELETE meanwhile
            if not kept:
                gate.drop(action_id)  # held, or handed to the engine as its client went: nobody waits for it now
            raise
        # a cancelled handler (client gone) cancels the action, unless it is kept
        outcome = await (asyncio.shield(rt.wait(action_id)) if kept else rt.wait(action_id))
    finally:
        waiters.pop(action_id, None)
    return web.json_response(outcome.as_dict())


async def get_action(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME_KEY]
    action_id = request.match_info["id"]
    gate = request.app[GATE_KEY]
    held = gate.held_state(action_id) or gate.cancelled_outcome(action_id)
    if held is not None:
        return web.json_response(held if isinstance(held, dict) else {"id": action_id, "status": held})
    try:
        outcome = rt.result(action_id)
    except UnknownActionError:  # from before a restart, or forgotten by the runtime: the durable record
        return _stored(request, action_id)
    if outcome is not None:
        return web.json_response(outcome.as_dict())
    return web.json_response({"id": action_id, "status": rt.state(action_id)})


async def cancel_action(request: web.Request) -> web.Response:
    """Cancel; answers with the final result once the executor killed the work (202 if that takes long)."""
    rt = request.app[RUNTIME_KEY]
    action_id = request.match_info["id"]
    gate = request.app[GATE_KEY]
    if gate.cancel_held(action_id) or gate.cancelled_outcome(action_id) is not None:
        return web.json_response(gate.cancelled_outcome(action_id))
    try:
        rt.cancel(action_id)
    except UnknownActionError:  # finished before a restart (or long ago): nothing to cancel
        return _stored(request, action_id)
    outcome = rt.result(action_id)
    if outcome is None:
        outcome = await rt.wait_finished(action_id, CANCEL_WAIT_S)
        if outcome is None:
            return web.json_response({"id": action_id, "status": "cancelling"}, status=202)
    return web.json_response(outcome.as_dict())


async def stats(request: web.Request) -> web.Response:
    return web.json_response({**request.app[RUNTIME_KEY].stats(), "admission": request.app[GATE_KEY].stats()})


async def metrics(request: web.Request) -> web.Response:
    body, ctype = request.app[METRICS_KEY].render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


def _flag(v: str, field: str) -> bool:
    lv = v.lower()
    if lv in ("1", "true", "yes", ""):
        return True
    if lv in ("0", "false", "no"):
        return False
    raise DemandError(field, f"must be true or false, got {v!r}")


# ---------------------------------------------------------------------------- #
# running


KEEPALIVE_S = 75.0  # an idle keep-alive connection is closed then (nginx's default), not after aiohttp's hour


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``host:port`` (0: any free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    svc = app[CONFIG_KEY].service
    ctx = tls_context(svc.tls_cert, svc.tls_key) if svc.tls_cert else None
    site = GuardedSite(runner, host, port, deadline=app[DEADLINE_KEY], ssl_context=ctx)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound
