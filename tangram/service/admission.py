"""Admission control: bounded queues per job and in total, and fair sharing between jobs.

The service never queues without bound. Every accepted action counts
against its *job* (the ``X-Tangram-Job`` header; without it, the caller's
address) until it finishes:

* a job past ``max_per_job`` unfinished actions gets ``429`` with
  ``Retry-After`` (that job is over its share; others are not affected);
* past ``max_total`` for the whole service, everyone gets ``503`` with
  ``Retry-After``.

``Retry-After`` is when room is likely: the finishes that make it (one for the
service; for a job, one of its own: about one in total / its share) at the rate
actions have been finishing (runs that ended, idle spells left out), 1 to 60 s. (It was the whole queue's
drain time at the policy's default duration: clients told to wait a minute
while the service drained in seconds and idled.)

Fair sharing: the engine sees at most ``window`` waiting actions at once
(enough for the policy's look-ahead). Past that, accepted actions wait
here in one FIFO per job, and are handed to the engine round-robin across
jobs, so a burst of one job delays another job's next action by at most one
action per other job, never by the whole burst. An action held here reports
status ``waiting`` like one in the engine's queue, and can be cancelled.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tangram.core.errors import UnavailableError, UnknownActionError

log = logging.getLogger("tangram.service")

_RATE_WEIGHT = 0.1  # of the newest gap between two finishes in their moving average
_GAP_MAX_S = 60.0  # a longer gap counts as this: Retry-After is at most 60 s anyway
_RAN = frozenset({"succeeded", "failed", "timeout"})  # ends that measure how fast work ends

FINAL = frozenset({"succeeded", "failed", "timeout", "cancelled"})


class Refused(Exception):
    """An action the service will not queue now: ``status`` 429 (this job) or 503 (the service)."""

    def __init__(self, status: int, reason: str, retry_after_s: int):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class _Held:
    action: Any
    received_at: float
    job: str
    held_at: float  # the runtime's clock when it began to wait here
    submitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairGate:
    """Between the wire and the runtime: bounds, per-job FIFOs, round-robin hand-over."""

    def __init__(self, runtime: Any, *, max_total: int, max_per_job: int, window: int, poll_s: float = 0.02,
                 on_finished: Callable[[str, dict], None] | None = None):
        self.rt = runtime
        # told the outcome of an action that ended here, never reaching the runtime (whose listeners
        # record the others): the state store keeps it, else its row stayed unfinished for good
        self.on_finished = on_finished
        self.max_total = int(max_total)
        self.max_per_job = int(max_per_job)
        self.window = max(1, int(window))
        self.poll_s = poll_s
        self._held: dict[str, collections.deque[_Held]] = {}  # job -> FIFO of held actions
        self._by_id: dict[str, _Held] = {}
        self._live: collections.Counter[str] = collections.Counter()  # job -> its ids in _job_of (none: absent)
        self._rr = itertools.count()
        self._cancelled: collections.OrderedDict[str, dict] = collections.OrderedDict()  # bounded
        self._task: asyncio.Task | None = None
        self._closed = False
        self.refused = {429: 0, 503: 0}
        self.ended_here = {"cancelled": 0, "failed": 0}  # held actions that never reached the engine
        self._job_of: dict[str, str] = {}  # submitted, unfinished action -> its job (the runtime tells its end)
        # mean seconds between two finished actions (moving average): when a refused caller will find room
        self._interval_s: float | None = None
        self._last_finish: float | None = None
        runtime.listeners.append(self._on_finish)  # told every end of what it handed over

    # ------------------------------------------------------------------ #

    def _on_finish(self, rjob: Any, _outcome: Any) -> None:
        """A runtime listener: an action handed over here ended; its job counts one less at once."""
        aid = rjob.action.id
        job = self._job_of.pop(aid, None)
        if job is not None:
            self._live[job] -= 1
            if not self._live[job]:
                del self._live[job]
        if _outcome.status not in _RAN:
            return  # a cancelled or refused one: a burst of them says nothing of how fast work ends
        now = time.monotonic()
        if self._last_finish is not None:
            gap = min(now - self._last_finish, _GAP_MAX_S)
            self._interval_s = gap if self._interval_s is None else self._interval_s + _RATE_WEIGHT * (
                gap - self._interval_s)
        # nothing left running or waiting: the next gap would hold an idle spell, not a rate
        eng = self.rt.engine
        self._last_finish = now if (eng.running or eng.waiting or self._by_id) else None

    def count(self, job: str) -> int:
        """Unfinished actions of ``job``: handed over (the runtime tells each end) or held here."""
        return self._live[job] + len(self._held.get(job, ()))

    def total(self) -> int:
        return len(self._job_of) + len(self._by_id)

    @property
    def closing(self) -> bool:
        """The service is stopping: what is cancelled now is cancelled by the shutdown."""
        return self._closed

    def check(self, job: str) -> None:
        """Raise :class:`Refused` if ``job`` could not be offered an action now. Cheap, and it writes
        nothing: the service calls it before recording the action, so a refusal costs no write."""
        if self._closed:  # shutting down: a request still arriving on an open connection
            raise Refused(503, "the service is stopping", 1)
        n = self.count(job)
        total = self.total()
        if n >= self.max_per_job:
            self.refused[429] += 1
            # its room comes when one of its own ends: about one finish in total / n (its share)
            raise Refused(429, f"job {job!r} has {self.max_per_job} unfinished actions (service.max_queued_per_job)",
                          self._retry_after((n - self.max_per_job + 1) * max(1, total) / n))
        if total >= self.max_total:
            self.refused[503] += 1
            raise Refused(503, f"the service holds {self.max_total} unfinished actions (service.max_queued_total)",
                          self._retry_after(total - self.max_total + 1))

    def offer(self, job: str, action: Any, received_at: float) -> str:
        """Accept ``action`` (submitted now, or held for its turn) or raise :class:`Refused`."""
        self.check(job)
        if not self._held and len(self.rt.engine.waiting) < self.window:
            self._submit(job, action, received_at)
            return action.id
        if action.id in self._by_id:
            raise ValueError(f"action {action.id!r} was already submitted")
        held = _Held(action, received_at, job, self.rt.clock())
        self._held.setdefault(job, collections.deque()).append(held)
        self._by_id[action.id] = held
        self._ensure_pump()
        return action.id

    def _submit(self, job: str, action: Any, received_at: float, held_s: float = 0.0) -> None:
        self.rt.submit(action, received_at=received_at, held_s=held_s)  # held here: queueing, not overhead
        self._live[job] += 1
        self._job_of[action.id] = job

    def _retry_after(self, finishes: float) -> int:
        """Seconds (1 to 60) until ``finishes`` more actions have likely ended, making room: at the rate
        they have been ending. A caller told more waits while the service idles; told less, it is
        refused again, which costs a request."""
        interval = self._interval_s
        if interval is None:  # none ended yet: the policy's default duration over what runs
            interval = getattr(self.rt.engine.params, "default_duration_s", 1.0) / max(1, len(self.rt.engine.running))
        return max(1, min(60, math.ceil(finishes * interval)))

    # ------------------------------------------------------------------ #

    def pump(self) -> None:
        """Hand held actions to the engine, one job after another, while the window has room."""
        while self._held and len(self.rt.engine.waiting) < self.window:
            jobs = list(self._held)
            job = jobs[next(self._rr) % len(jobs)]
            q = self._held[job]
            held = q.popleft()
            if not q:
                del self._held[job]
            del self._by_id[held.action.id]
            try:
                self._submit(job, held.action, held.received_at, self.rt.clock() - held.held_at)
            except Exception as exc:  # noqa: BLE001 - e.g. its environment was deleted meanwhile
                if not held.submitted.done():
                    held.submitted.set_exception(exc)
                    held.submitted.exception()  # a waiter still gets it; without one it is recorded below
                outcome = {"id": held.action.id, "status": "failed", "error": f"not started: {exc}",
                           "allocation": {}}
                if isinstance(exc, UnavailableError):
                    outcome["retryable"] = True  # not now (its node is down): resubmit
                self._ended(held.action.id, outcome)
                continue
            if not held.submitted.done():
                held.submitted.set_result(None)

    def _ensure_pump(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump_loop())

    async def _pump_loop(self) -> None:
        while self._held:
            self.pump()
            if self._held:
                await asyncio.sleep(self.poll_s)

    async def submitted(self, action_id: str) -> None:
        """Wait until a held action reached the engine (at once if it is not held)."""
        held = self._by_id.get(action_id)
        if held is not None:
            await asyncio.shield(held.submitted)

    def held_state(self, action_id: str) -> str | None:
        return "waiting" if action_id in self._by_id else None

    def cancel_held(self, action_id: str) -> bool:
        held = self._by_id.pop(action_id, None)
        if held is None:
            return False
        q = self._held.get(held.job)
        if q is not None:
            q.remove(held)
            if not q:
                del self._held[held.job]
        if not held.submitted.done():
            held.submitted.cancel()
        outcome = {"id": action_id, "status": "cancelled", "error": "cancelled before it started", "allocation": {}}
        self._cancelled[action_id] = outcome
        while len(self._cancelled) > self.max_total:
            self._cancelled.popitem(last=False)
        self._ended(action_id, outcome)
        return True

    def _ended(self, action_id: str, outcome: dict) -> None:
        self.ended_here[outcome["status"]] = self.ended_here.get(outcome["status"], 0) + 1
        if self.on_finished is not None:
            try:
                self.on_finished(action_id, outcome)
            except Exception:  # noqa: BLE001 - as the runtime's listeners: never break the gate
                log.exception("recording the outcome of %s failed", action_id)

    def drop(self, action_id: str) -> bool:
        """The client waiting for ``action_id`` went: cancel it held here, else in the runtime (the
        gate may have handed it over at the moment the client went, when nobody waits for it any
        more); False when it had already ended."""
        if self.cancel_held(action_id):
            return True
        try:
            if self.rt.cancel(action_id):
                log.info("action %s cancelled: its client disconnected", action_id)
                return True
        except UnknownActionError:
            pass  # it ended, and the runtime forgot it, meanwhile
        return False

    def cancelled_outcome(self, action_id: str) -> dict | None:
        return self._cancelled.get(action_id)

    def stats(self) -> dict:
        return {"held": len(self._by_id), "jobs": len(set(self._live) | set(self._held)), "window": self.window,
                "max_total": self.max_total, "max_per_job": self.max_per_job, "refused": dict(self.refused),
                "ended_held": dict(self.ended_here)}

    async def close(self) -> None:
        self._closed = True
        for aid in list(self._by_id):
            self.cancel_held(aid)
        if self._task is not None:
            self._task.cancel()


def job_of(headers: Any, peer: Callable[[], str | None]) -> str:
    job = headers.get("X-Tangram-Job")
    if job:
        return job[:128]
    return f"peer:{peer() or 'unknown'}"
