"""Basic manager: concurrency and quota limits of API pools (DESIGN.md §5).

Each pool ``api:<name>`` may have

* a **concurrency** limit: at most ``concurrency`` units in flight; a unit is
  taken at grant and given back at release (the call returned);
* a **quota**: at most ``quota`` calls per ``period_s`` *as the upstream
  counts them*. The upstream counts a call when it arrives, somewhere between
  our dispatch and its answer, on its own clock; a call counts from its
  dispatch until the upstream's window has surely forgotten it, i.e. from its
  latest possible arrival. That is ``dispatch + arrival_margin_s`` when a
  margin is configured (for grants that are the call itself, see below; any
  other counts to its end). Otherwise ``books`` says:

  - ``adaptive`` (default): ``dispatch + ADAPTIVE_MARGIN_S`` (or the answer, if
    sooner) until the upstream answers the pool's first 429; from then on the
    conservative books below. A 429 is absorbed (the call is re-queued), so a
    wrong guess costs one round of 429s per pool: calls in flight when it
    comes, and calls the guess had already let go of that still reach the
    upstream late (within the longest such delay and a period). Any 429
    withdraws the guess, one caused by another client on the same key too, for
    the manager's life (a restart guesses again). The guess applies only to
    grants that are the call itself, whose answer the runtime reads
    (:meth:`BasicManager.observe_response`): ``http`` actions (the
    simulator's calls are too), or a grant with no action. Any other action
    holding the pool (an ``exec`` whose command calls the API after its
    set-up; an action with no kind runs as one) counts to its end: its
    dispatch is not the call's, and its 429s never reach us. The gain
    is the pool's quota: conservative books send about
    ``period / (period + call latency)`` of it when the pool is busy.
  - ``conservative``: the answer (release); never a 429 from our own calls,
    whenever the upstream counts them.

  Two kinds of window:

  - ``sliding`` (default): any interval of length ``period_s`` holds at most
    ``quota`` arrivals; a unit comes back at latest arrival + ``period_s``.
    This also satisfies an upstream counting fixed windows of any alignment.
  - ``fixed``: windows ``[origin + k*period, origin + (k+1)*period)``; a call
    counts in every window its possible arrival times touch, so one still in
    flight at a boundary also counts in the next window. ``origin`` is the
    manager's creation, moved onto the upstream's boundary as soon as an
    answer reports it (``X-RateLimit-Reset`` / ``RateLimit-Reset``).

:meth:`BasicManager.observe_response` reads what the upstream says about its
own books: a 429 pauses the pool for ``Retry-After`` (the runtime re-queues
the call), a reported ``Remaining`` below ours raises the count.

The policy sees each pool's ``free = min(concurrency free, quota left)``
(0 while paused) and ``capacity = min(concurrency, quota)``;
:meth:`BasicManager.next_wakeup` says when quota comes back, so the engine
waits for capacity instead of letting a call fail with a 429.

Books (checked by :meth:`check_invariants`): ``slots_free + in_flight ==
concurrency`` and ``quota_left + consumed == quota``.

The clock is injected (``time.monotonic`` by default) so the simulator can
drive the very same manager with a virtual clock.
"""
from __future__ import annotations

import email.utils
import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from tangram.core.errors import invariant
from tangram.core.model import Action
from tangram.managers.base import AllocationError, ResourceManager
from tangram.core.pools import PoolState

log = logging.getLogger(__name__)

SLIDING, FIXED = "sliding", "fixed"
ADAPTIVE, CONSERVATIVE = "adaptive", "conservative"
# The adaptive books' guess of how late after dispatch the upstream receives a call: a new
# connection's TCP and TLS 1.2 handshakes take 3 round trips before the request goes out, 0.45 s
# at an intercontinental 150 ms round trip; a kept-alive connection takes half of one.
ADAPTIVE_MARGIN_S = 0.5
BOOKS_NEED = "needs a quota, and no arrival_margin_s (a stated margin is the books)"
DEFAULT_429_PAUSE_S = 1.0  # a 429 without Retry-After on a pool without a quota period
MAX_429_PAUSE_S = 3600.0  # a bogus Retry-After never parks a pool longer than this


@dataclass(frozen=True, slots=True)
class ApiLimit:
    """Limits of one API pool; at least one of ``concurrency`` and ``quota``."""

    concurrency: int | None = None
    quota: int | None = None
    period_s: float | None = None
    window: str = SLIDING
    # how late after dispatch the upstream can receive a call; None: ``books`` decides
    arrival_margin_s: float | None = None
    books: str = ADAPTIVE  # without a margin: "adaptive" or "conservative" (module docstring)

    def validate(self, field: str) -> None:
        for name in ("concurrency", "quota"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{field}.{name}: must be a positive integer, got {v!r}")
        if self.concurrency is None and self.quota is None:
            raise ValueError(f"{field}: needs a concurrency limit, a quota, or both")
        if self.quota is not None:
            p = self.period_s
            if p is None or isinstance(p, bool) or not isinstance(p, (int, float)) or not (p > 0) or math.isinf(p):
                raise ValueError(f"{field}.period_s: a quota needs a positive finite period, got {p!r}")
        elif self.period_s is not None:
            raise ValueError(f"{field}.period_s: given without a quota")
        if self.window not in (SLIDING, FIXED):
            raise ValueError(f"{field}.window: must be 'sliding' or 'fixed', got {self.window!r}")
        m = self.arrival_margin_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m < math.inf)):
            raise ValueError(f"{field}.arrival_margin_s: must be a non-negative finite number of seconds, got {m!r}")
        if self.books not in (ADAPTIVE, CONSERVATIVE):
            raise ValueError(f"{field}.books: must be 'adaptive' or 'conservative', got {self.books!r}")
        if self.books != ADAPTIVE and (self.quota is None or m is not None):
            raise ValueError(f"{field}.books: {BOOKS_NEED}")

    @classmethod
    def parse(cls, raw: "ApiLimit | Mapping[str, Any]", field: str) -> "ApiLimit":
        if isinstance(raw, ApiLimit):
            lim = raw
        elif isinstance(raw, Mapping):
            unknown = set(raw) - {"concurrency", "quota", "period_s", "window", "arrival_margin_s", "books"}
            if unknown:
                raise ValueError(f"{field}: unknown keys {sorted(unknown)} "
                                 "(expected concurrency, quota, period_s, window, arrival_margin_s, books)")
            lim = cls(**raw)
        else:
            raise ValueError(f"{field}: expected an ApiLimit or a mapping, got {type(raw).__name__}")
        lim.validate(field)
        return lim


class _Grant:
    """One grant's times: when it was dispatched and released (None while in flight)."""

    __slots__ = ("dispatched", "released", "units", "expires", "is_call")

    def __init__(self, dispatched: float, units: int, is_call: bool = True):
        self.dispatched = dispatched
        self.is_call = is_call  # dispatched as the API call itself (the adaptive guess applies)
        self.released: float | None = None
        self.units = units
        self.expires = math.inf  # sliding windows: when the unit leaves the upstream's window


class _Pool:
    """Books of one API pool."""

    __slots__ = ("name", "limit", "holders", "in_flight", "live", "grants", "expiry", "consumed",
                 "window_start", "blocked_until", "upstream_429s", "adapting", "known_free")

    def __init__(self, name: str, limit: ApiLimit, origin: float):
        self.name = name
        self.limit = limit
        self.holders: dict[str, int] = {}
        self.in_flight = 0
        self.live: dict[str, tuple[int, _Grant]] = {}  # holder -> its in-flight grant
        self.grants: dict[int, _Grant] = {}  # seq -> grant still counted against the quota
        self.expiry: list[tuple[float, int, _Grant]] = []  # sliding: heap of (expires, seq, grant)
        self.consumed = 0  # quota units counted now (sliding) or in the current window (fixed)
        self.window_start = origin  # fixed windows only
        self.blocked_until = -math.inf  # the upstream asked us to wait (429 + Retry-After)
        self.upstream_429s = 0
        # whether the adaptive guess holds (the first 429 withdraws it)
        self.adapting = limit.arrival_margin_s is None and limit.books == ADAPTIVE and limit.quota is not None
        # free units as the engine last knew them (what pool_states reported, less what it took since):
        # units that came back on their own beyond it (a refill, a pause's end) wait for a round
        self.known_free = 0

    @property
    def capacity(self) -> int:
        caps = [c for c in (self.limit.concurrency, self.limit.quota) if c is not None]
        return min(caps)

    def latest_arrival(self, g: _Grant) -> float:
        """The latest the upstream can have received ``g``: before its answer, and within the margin."""
        bound = math.inf if g.released is None else g.released
        if not g.is_call:
            return bound
        margin = self.limit.arrival_margin_s
        if margin is None and self.adapting:
            margin = ADAPTIVE_MARGIN_S
        return bound if margin is None else min(bound, g.dispatched + margin)

    def schedule_expiry(self, seq: int, g: _Grant) -> None:
        """Move ``g``'s expiry to its latest arrival + period: sooner at its answer, later when the
        guess is withdrawn; the superseded heap entry is skipped when popped (:meth:`_current`)."""
        if self.limit.window != SLIDING or self.grants.get(seq) is not g:
            return
        expires = self.latest_arrival(g) + float(self.limit.period_s)
        if expires != g.expires:
            g.expires = expires
            if expires < math.inf:  # in flight with no margin: only its answer starts the countdown
                heapq.heappush(self.expiry, (expires, seq, g))

    def _current(self, entry: tuple[float, int, _Grant]) -> bool:
        """Whether a heap entry is its grant's expiry now (not superseded, the grant still counted)."""
        expires, seq, g = entry
        return g.expires == expires and self.grants.get(seq) is g

    def withdraw_margin(self) -> None:
        """The upstream counted a call later than the adaptive guess: count every call to its answer."""
        self.adapting = False
        for seq, g in self.grants.items():  # fixed windows: latest_arrival, read at each boundary
            self.schedule_expiry(seq, g)

    def refresh(self, now: float) -> None:
        """Return to the quota what the upstream no longer counts at ``now``."""
        lim = self.limit
        if lim.quota is None:
            return
        period = float(lim.period_s)
        if lim.window == SLIDING:
            while self.expiry and self.expiry[0][0] <= now:
                entry = heapq.heappop(self.expiry)
                if self._current(entry):
                    del self.grants[entry[1]]
                    self.consumed -= entry[2].units
        elif now >= self.window_start + period:
            # at least one whole period (float division can round just below a boundary)
            self.window_start += max(1, math.floor((now - self.window_start) / period)) * period
            # a call that may still arrive in this window counts in it too
            self.grants = {h: g for h, g in self.grants.items() if self.latest_arrival(g) >= self.window_start}
            self.consumed = min(sum(g.units for g in self.grants.values()), lim.quota)

    def quota_left(self) -> int | None:
        return None if self.limit.quota is None else self.limit.quota - self.consumed

    def slots_free(self) -> int | None:
        return None if self.limit.concurrency is None else self.limit.concurrency - self.in_flight

    def free(self, now: float) -> int:
        if now < self.blocked_until:
            return 0
        vals = [v for v in (self.slots_free(), self.quota_left()) if v is not None]
        return max(min(vals), 0)

    def refill_at(self, now: float) -> float | None:
        """When the pool next gains units on its own (None if only a release can free them)."""
        if now < self.blocked_until:
            return self.blocked_until
        if self.limit.quota is None or self.consumed == 0:
            return None
        if self.limit.window == SLIDING:
            # entries superseded by a later expiry (a withdrawn guess) would wake the engine for nothing
            while self.expiry and not self._current(self.expiry[0]):
                heapq.heappop(self.expiry)
            return self.expiry[0][0] if self.expiry else None
        return self.window_start + float(self.limit.period_s)


class BasicManager(ResourceManager):
    """Concurrency slots and quotas of ``api:<name>`` pools (no policy: it only counts)."""

    def __init__(self, limits: Mapping[str, ApiLimit | Mapping[str, Any]], *,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        origin = clock()
        self._pools: dict[str, _Pool] = {}
        self._seq = 0
        for key, raw in limits.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"limits: pool names must be non-empty strings, got {key!r}")
            name = key if key.startswith("api:") else f"api:{key}"
            if len(name) <= 4:
                raise ValueError(f"limits[{key!r}]: empty API name")
            if name in self._pools:
                raise ValueError(f"limits[{key!r}]: pool {name!r} configured twice")
            self._pools[name] = _Pool(name, ApiLimit.parse(raw, f"limits[{key!r}]"), origin)

    # ------------------------------------------------------------------ #

    def _pool(self, pool: str) -> _Pool:
        p = self._pools.get(pool)
        if p is None:
            raise AllocationError(f"unknown pool {pool!r} (this manager owns {sorted(self._pools)})")
        return p

    def pool_states(self) -> Iterable[PoolState]:
        now = self.clock()
        for p in self._pools.values():
            p.refresh(now)
            p.known_free = free = p.free(now)
            yield PoolState(name=p.name, rtype=p.name, node=None, capacity=p.capacity, free=free)

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> int:
        p = self._pool(pool)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise AllocationError(f"{pool}: units must be a positive integer, got {units!r}")
        if holder in p.holders:
            raise AllocationError(f"{pool}: {holder!r} already holds {p.holders[holder]} units")
        now = self.clock()
        p.refresh(now)
        free = p.free(now)
        if units > free:
            raise AllocationError(f"{pool}: {units} units requested, {free} free (slots free {p.slots_free()}, "
                                  f"quota left {p.quota_left()}, upstream pause until {p.blocked_until:g})")
        p.holders[holder] = units
        p.in_flight += units
        p.known_free = max(0, p.known_free - units)
        if p.limit.quota is not None:
            self._seq += 1
            # an action of another kind holding the pool makes its call later, and we never see its answer
            # (an action with no kind runs as an exec); no action: the caller makes the call itself
            g = _Grant(now, units, is_call=action is None or action.payload.get("kind") == "http")
            p.live[holder] = (self._seq, g)
            p.grants[self._seq] = g
            p.consumed += units
            p.schedule_expiry(self._seq, g)  # only with a margin: in flight, it expires at dispatch + margin + period
        return units

    def release(self, pool: str, holder: str) -> bool:
        p = self._pools.get(pool)
        if p is None:
            return False
        units = p.holders.pop(holder, None)
        if units is None:
            return False
        p.in_flight -= units
        live = p.live.pop(holder, None)
        now = self.clock()
        if live is not None:  # the quota unit stays counted until the upstream's window forgets the call
            seq, g = live
            g.released = now
            p.schedule_expiry(seq, g)
        p.known_free = min(p.known_free + units, p.free(now))  # the engine's next round sees the slot
        return True

    def refilled_unseen(self, now: float) -> bool:
        """Whether a pool has more free units than the engine last read (:meth:`pool_states`) and took:
        they came back on their own (a quota refill, the end of an upstream's pause) after the last
        round read the pools, for instance while the round ran or before the runtime asked for its
        next wake-up, which then lies in the past and is not given: a round must run now."""
        for p in self._pools.values():
            p.refresh(now)
            if p.free(now) > p.known_free:
                return True
        return False

    def next_wakeup(self, now: float) -> float | None:
        times = []
        for p in self._pools.values():
            p.refresh(now)
            t = p.refill_at(now)
            if t is not None:
                times.append(t)
        return min(times) if times else None

    # ------------------------------------------------------------------ #
    # what the upstream said about its own books

    def observe_response(self, pool: str, status: int | None, headers: Mapping[str, str] | None,
                         holder: str | None = None) -> float | None:
        """Align the books with an upstream answer; for a 429, the seconds to wait before calling again.

        ``Retry-After`` pauses the whole pool (no grant until it passes);
        ``X-RateLimit-Remaining`` / ``RateLimit-Remaining`` raise the units
        counted in the current window when the upstream counted more (another
        client shares the key); ``X-RateLimit-Reset`` / ``RateLimit-Reset``
        move a fixed window's boundary onto the upstream's. A sliding pool the
        upstream says is spent (``Remaining: 0``) pauses until its reset,
        counted from the answer; under the adaptive guess, from the call's
        latest arrival (``holder``: the call answered, still holding its grant):
        a gateway states its books when the call arrives, so a reset counted from
        a slow call's answer held the pool a call's latency too long.
        """
        p = self._pools.get(pool)
        if p is None:
            return None
        now = self.clock()
        p.refresh(now)
        h = {k.lower(): v for k, v in (headers or {}).items()}
        reset = _reset_after(h)
        remaining = _first_int(h, ("x-ratelimit-remaining", "ratelimit-remaining"))
        lim = p.limit
        if lim.quota is not None and lim.window == FIXED and reset is not None:
            period = float(lim.period_s)
            if 0 < reset <= period:
                # the upstream's window ends at now + reset; keep what we counted (never refill on a move)
                p.window_start = now + reset - period
        if lim.quota is not None and remaining is not None and (lim.window == FIXED or remaining == 0):
            extra = lim.quota - max(0, min(remaining, lim.quota)) - p.consumed
            if extra > 0 and lim.window == SLIDING:
                # the other client's calls are counted as a grant that arrived now: it leaves the window
                # a period later, as ours do (units counted without a grant never came back: the pool
                # kept losing quota for good, down to none with no wake-up)
                self._seq += 1
                g = _Grant(now, extra)
                g.released = now
                p.grants[self._seq] = g
                p.schedule_expiry(self._seq, g)
            p.consumed += max(extra, 0)
            if lim.window == SLIDING and p.consumed == lim.quota and reset is not None:
                live = p.live.get(holder) if holder is not None and p.adapting else None
                told = min(now, p.latest_arrival(live[1])) if live is not None else now
                p.blocked_until = max(p.blocked_until, told + min(reset, MAX_429_PAUSE_S))  # a bogus reset too
        if status != 429:
            return None
        p.upstream_429s += 1
        if p.adapting:
            p.withdraw_margin()
            log.warning("%s: the upstream answered 429 under the adaptive quota books; counting each call "
                        "until its answer from now on (state arrival_margin_s or books: conservative to choose)",
                        p.name)
        delay = _retry_after(h)
        if delay is None:
            delay = reset
        if delay is None:  # no hint: a full period for a quota, else a short pause
            delay = float(lim.period_s) if lim.quota is not None else DEFAULT_429_PAUSE_S
        delay = min(max(delay, 0.0), MAX_429_PAUSE_S)
        p.blocked_until = max(p.blocked_until, now + delay)
        return delay

    def books(self) -> Mapping[str, str]:
        """Each quota pool's books now: ``adaptive`` (the guess holds), ``conservative`` or ``margin``."""
        return {name: ("margin" if p.limit.arrival_margin_s is not None else ADAPTIVE if p.adapting else CONSERVATIVE)
                for name, p in self._pools.items() if p.limit.quota is not None}

    def upstream_429s(self) -> Mapping[str, int]:
        """429 answers the upstream gave per pool (each one absorbed or returned by the runtime)."""
        return {name: p.upstream_429s for name, p in self._pools.items()}

    # ------------------------------------------------------------------ #

    def check_invariants(self) -> None:
        for p in self._pools.values():
            held = sum(p.holders.values())
            invariant(held == p.in_flight, f"{p.name}: holders have {held}, books say {p.in_flight} in flight")
            lim = p.limit
            if lim.concurrency is not None:
                invariant(p.slots_free() + p.in_flight == lim.concurrency, f"{p.name}: concurrency books")
                invariant(0 <= p.in_flight <= lim.concurrency, f"{p.name}: {p.in_flight} in flight of {lim.concurrency}")
            if lim.quota is not None:
                invariant(0 <= p.consumed <= lim.quota, f"{p.name}: consumed {p.consumed} of quota {lim.quota}")
                invariant(p.quota_left() + p.consumed == lim.quota, f"{p.name}: quota books")
                invariant(set(p.live) == set(p.holders), f"{p.name}: in-flight grants disagree with holders")
                if lim.window == SLIDING:
                    counted = sum(g.units for g in p.grants.values())
                    invariant(counted == p.consumed, f"{p.name}: window grants {counted}, consumed {p.consumed}")

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        return {name: dict(p.holders) for name, p in self._pools.items()}

    def limits(self) -> Mapping[str, ApiLimit]:
        return {name: p.limit for name, p in self._pools.items()}


def _first_int(h: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for n in names:
        v = h.get(n)
        if v is not None:
            try:
                return int(float(v.split(",")[0].strip()))
            except ValueError:
                return None
    return None


def _seconds(value: str | None) -> float | None:
    """A delay in seconds; an HTTP date or a Unix time becomes the delay until it."""
    if value is None:
        return None
    try:
        v = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        return when.timestamp() - time.time()
    if not math.isfinite(v) or v < 0:
        return None
    return v - time.time() if v > 1e9 else v  # a Unix time (GitHub style) vs delta seconds


def _retry_after(h: Mapping[str, str]) -> float | None:
    d = _seconds(h.get("retry-after"))
    return None if d is None else max(d, 0.0)


def _reset_after(h: Mapping[str, str]) -> float | None:
    for n in ("x-ratelimit-reset", "ratelimit-reset"):
        d = _seconds(h.get(n))
        if d is not None:
            return max(d, 0.0)
    return None
