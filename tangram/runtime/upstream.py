"""An HTTP action's answer handed to the managers of the API pools it held (their quota books)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from tangram.executors.base import ExecResult


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
