"""An HTTP action's answer handed to the managers of the API pools it held (their quota books), and a
429 re-queued for the pause they take from it."""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from tangram.core.errors import UnknownActionError
from tangram.executors.base import ExecResult
from tangram.runtime.job import Job

log = logging.getLogger("tangram.runtime")

# an http action without timeout_s is re-queued after upstream 429s until this long after it was received
HTTP_429_DEADLINE_S = 600.0


def upstream_pause(engine: Any, pools: Iterable[str], result: ExecResult,
                   action_id: str) -> tuple[Any, float | None, str | None]:
    """``(the answer's status, the longest pause a pool's manager takes from it, that pool)``: each
    API pool's manager reads the status and rate headers (``observe_response``); the driver
    re-queues a 429 for the pause."""
    out = result.output if isinstance(result.output, Mapping) else {}
    status = out.get("status")
    headers = result.rate_headers or {}
    delay = pool = None
    for name in pools:
        observe = getattr(engine.manager_of(name), "observe_response", None)
        if name.startswith("api:") and observe is not None:
            d = observe(name, status, headers, action_id)
            if d is not None and (delay is None or d > delay):
                delay, pool = d, name
    return status, delay, pool


def requeue_after_429(engine: Any, job: Job, pools: Iterable[str], result: ExecResult, now: float,
                      absorbed: dict[str, int]) -> list | None:
    """Hand the upstream's answer to its pools' managers; None if it is the action's result, else the
    actions the engine starts now that it re-queued a 429 instead (``absorbed[pool]`` counts it).

    The manager pauses the pool for the advertised delay; the action goes back to the head of the
    queue unless that delay would pass its deadline (``timeout_s`` after it was received, else
    ``HTTP_429_DEADLINE_S``) or it has an outcome already.
    """
    status, delay, pool = upstream_pause(engine, pools, result, job.action.id)
    if status != 429 or delay is None or job.outcome is not None:
        return None
    budget = job.action.timeout_s if job.action.timeout_s is not None else HTTP_429_DEADLINE_S
    if now + delay >= job.received_at + budget:
        return None
    job.requeues += 1
    absorbed[pool] = absorbed.get(pool, 0) + 1
    log.info("action %s: upstream 429 on %s, re-queued (pause %.3g s)", job.action.id, pool, delay)
    try:
        return engine.requeue(job.action.id)
    except UnknownActionError:  # cancelled meanwhile (close, delete_environment)
        return None
