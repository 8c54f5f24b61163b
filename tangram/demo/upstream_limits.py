"""Limits enforced the way a hosted API enforces them, for local upstreams.

A hosted search or PDF API counts each call when it *arrives*, on its own
clock, and answers ``429 Too Many Requests`` with ``Retry-After`` when a call
is over its concurrency limit or over its quota for the period. This module is
that server side: :class:`UpstreamLimits` keeps the books (sliding or fixed
windows, counted at arrival; a refused call is not counted, as most APIs do)
and :func:`limits_middleware` puts them in front of an aiohttp app. The demo's
search service uses it, and the tests use it as the strict API that the basic
manager must never trip.

Every answer carries ``X-RateLimit-Limit``, ``X-RateLimit-Remaining`` and
``X-RateLimit-Reset`` (seconds until the current window frees a unit, with
millisecond precision); a 429 also carries ``Retry-After`` in whole seconds
(RFC 9110 allows no fraction), rounded up.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

SLIDING, FIXED = "sliding", "fixed"


@dataclass(slots=True)
class LimitStats:
    admitted: int = 0
    refused_concurrency: int = 0
    refused_quota: int = 0
    peak_concurrency: int = 0
    arrivals: list[float] = field(default_factory=list)  # admitted arrival times (server clock)

    @property
    def refused(self) -> int:
        return self.refused_concurrency + self.refused_quota

    def as_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "refused_429": self.refused, "refused_concurrency": self.refused_concurrency,
                "refused_quota": self.refused_quota, "peak_concurrency": self.peak_concurrency}


class UpstreamLimits:
    """A concurrency limit and/or a quota per period, counted at arrival on this clock."""

    def __init__(self, *, concurrency: int | None = None, quota: int | None = None, period_s: float | None = None,
                 window: str = SLIDING, clock: Callable[[], float] = time.monotonic):
        if concurrency is None and quota is None:
            raise ValueError("limits: need a concurrency limit, a quota, or both")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency!r}")
        if quota is not None and (quota < 1 or period_s is None or not period_s > 0):
            raise ValueError(f"quota: needs quota >= 1 and a positive period_s, got {quota!r} per {period_s!r}")
        if window not in (SLIDING, FIXED):
            raise ValueError(f"window: must be 'sliding' or 'fixed', got {window!r}")
        self.concurrency = concurrency
        self.quota = quota
        self.period_s = period_s
        self.window = window
        self.clock = clock
        self.origin = clock()
        self.in_flight = 0
        self._arrivals: deque[float] = deque()  # sliding: admitted arrivals still in the window
        self._window_index = 0  # fixed: which window ``_used`` counts
        self._used = 0
        self.stats = LimitStats()

    def _refresh(self, now: float) -> None:
        if self.quota is None:
            return
        if self.window == SLIDING:
            while self._arrivals and self._arrivals[0] + self.period_s <= now:
                self._arrivals.popleft()
            self._used = len(self._arrivals)
        else:
            k = math.floor((now - self.origin) / self.period_s)
            if k != self._window_index:
                self._window_index, self._used = k, 0

    def _reset_in(self, now: float) -> float:
        """Seconds until the quota next frees a unit (0 without a quota or when none is used)."""
        if self.quota is None or self._used == 0:
            return 0.0
        if self.window == SLIDING:
            return max(0.0, self._arrivals[0] + self.period_s - now)
        return max(0.0, self.origin + (self._window_index + 1) * self.period_s - now)

    def enter(self) -> tuple[bool, dict[str, str]]:
        """Admit or refuse one arriving call; returns (admitted, headers for the answer)."""
        now = self.clock()
        self._refresh(now)
        over_conc = self.concurrency is not None and self.in_flight >= self.concurrency
        over_quota = self.quota is not None and self._used >= self.quota
        if over_conc or over_quota:
            if over_quota:
                self.stats.refused_quota += 1
                wait = self._reset_in(now)
            else:
                self.stats.refused_concurrency += 1
                wait = 0.0
            headers = self.headers(now)
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
            return False, headers
        self.in_flight += 1
        self.stats.peak_concurrency = max(self.stats.peak_concurrency, self.in_flight)
        self.stats.admitted += 1
        self.stats.arrivals.append(now)
        if self.quota is not None:
            self._used += 1
            if self.window == SLIDING:
                self._arrivals.append(now)
        return True, self.headers(now)

    def leave(self) -> None:
        self.in_flight -= 1

    def headers(self, now: float | None = None) -> dict[str, str]:
        if self.quota is None:
            return {}
        now = self.clock() if now is None else now
        return {"X-RateLimit-Limit": str(self.quota), "X-RateLimit-Remaining": str(max(0, self.quota - self._used)),
                "X-RateLimit-Reset": f"{self._reset_in(now):.3f}"}


def limits_middleware(limits: UpstreamLimits, *, exempt: frozenset[str] = frozenset()) -> Any:
    """An aiohttp middleware answering 429 (+ ``Retry-After``) over ``limits``; ``exempt`` paths are free."""
    from aiohttp import web  # lazy: the core never imports aiohttp

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path in exempt:
            return await handler(request)
        ok, headers = limits.enter()
        if not ok:
            return web.json_response({"error": "rate limit exceeded"}, status=429, headers=headers)
        try:
            resp = await handler(request)
        finally:
            limits.leave()
        resp.headers.update(headers)
        return resp

    return middleware
