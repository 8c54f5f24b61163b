"""Stop the training when the Tangram service cannot do the run's work (``max_consecutive_failures``).

Why: on verl's default path (``trainer.use_v1=true``) a sample whose rollout or reward raises does
not stop the run. ``AgentLoopWorkerTQ._run_prompt`` settles the prompt's sessions with
``return_exceptions=True`` and tags the group ``failure`` (verl 0.9.1,
``trainer/ppo/v1/agent_loop_tq.py`` 131-148); verl's replay buffer then trains on what is left of
the batch (sync trainer, the default; only a batch with no trajectory at all raises, telling the user
to enable ``sync_refill_failed_groups``) or evicts the group and refills it from the dataloader, with
no end (the async trainers, and sync with ``sync_refill_failed_groups``): a service that stays down
degrades or stalls the run without stopping it. (The legacy path, ``use_v1=false``, stops at the
first failure: ``AgentLoopWorker.generate_sequences`` gathers its samples without
``return_exceptions``.)

What counts, per process and service URL (only outcomes that say whether the service can do the
run's work count or reset):

* *adds one*: a call that failed after its retries (:func:`integrations.verl.session.retrying`)
  because the service could not be reached, did not answer within ``request_timeout_s``, answered
  5xx, refused the run's token (401, 403) or stayed full past ``admission_wait_s`` (429, or 503 with
  a Retry-After) -- :func:`service_failure`; an action the service answered but did not run
  (:func:`did_not_run`: an exec that ended with no exit code -- an executor error, its node down,
  ``retryable`` after a restart of the service, its environment deleted, a timeout no executor
  ended --; an http action cancelled or with no call made; a model action that did not succeed); a
  reward action that ran but gave no verdict on the response (a test command that could not run --
  exit 126, 127, pytest's 4 and 5 --, no pytest summary for ``score: fraction``, a reward model's
  unreadable or NaN score: :func:`integrations.verl.session.reward_failed`); a ``setup_command``
  that did not run or failed.
* *starts the count again*: a verdict only -- a tool's command that ran to an exit code (also one
  its executor killed at its timeout), an http call made (whatever the upstream answered), a reward
  scored.
* *neither*: every other answer (a created environment, the look-up of one whose creation lost its
  answer, a deleted one, an error about the request itself such as a 404 or a 422), deletes that
  fail, a sample whose rollout already failed (counted where it failed), a bad sample spec.

When it trips: once the count reaches ``max_consecutive_failures`` (default 32; 0 or null: never)
*and* failures keep coming, with no verdict between, for :func:`window_s` seconds after that
(``retry_s``, at least :data:`MIN_WINDOW_S`). One burst -- the calls in flight of a worker failing
together when an outage outlasts ``retry_s``, or answered ``retryable`` at once after a restart of
the service -- never trips by itself: the calls the rollout makes next get verdicts once the
service is back. A service that stays down fails those too and trips about ``window_s`` after the
count reached the setting.

How the run stops: the process *trips*: it logs the cause at ERROR and records it in the
``tangram_metrics`` Ray actor (told again at the next failure if that Ray call failed). The
trainer's process raises :class:`TangramServiceDown` (naming the service, the causes and what to do
for them, and the setting) the next time verl's replay buffer reads the rollout's state (every poll
of ``ReplayBuffer.sample``, so before the batch in collection is trained on) and after a step's
metrics are logged; nothing in verl catches it on the way to ``main_ppo``: the run stops. The
trainer's process is reached through the ``verl.plugins`` entry point (``TANGRAM_ENABLED=1``), as
for the metrics. A new ``fit`` forgets an earlier one's trip (when it builds verl's logger).

No verl import at module level.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from integrations.verl import metrics
from integrations.verl.config import TangramSettings
from tangram.client import ActionResult, TangramHTTPError

log = logging.getLogger("integrations.verl")

# besides "not reached / no answer in time" (status 0) and any 5xx: the service refuses this run's
# token (401, 403), or stayed full longer than admission_wait_s (429). None of them says anything
# about the request, and each fails every call of the run alike
_DOWN_STATUSES = frozenset({401, 403, 429})
_REPLAY_BUFFER = "verl.trainer.ppo.v1.replay_buffer"
# the least time failures must keep coming after the count reached the setting (also with a small
# retry_s): the answers of a restarted service to every action it had in flight (``retryable``) arrive
# within a few seconds, together
MIN_WINDOW_S = 30.0
_REPORTED = "_tangram_guard_reported"  # set on an exception once this module has seen it
_clock = time.monotonic

# cause -> (what the service did, what to do about it), for the trip's message
CAUSES: dict[str, tuple[str, str]] = {
    "unreachable": ("could not be reached", "start the service (or fix custom.tangram.url, or the network to it)"),
    "stalled": ("did not answer within request_timeout_s",
                "the service is stalled: read its log, restart it if it hangs"),
    "5xx": ("answered 5xx", "read the service's log (and that of any proxy in front of it)"),
    "token": ("refused the run's token",
              "give the run the service's token (custom.tangram.token or token_file, as the service's --token-file)"),
    "full": ("stayed full past admission_wait_s",
             "the service is overloaded, not down: raise custom.tangram.admission_wait_s, run fewer rollouts at "
             "once, or give the service more nodes"),
    "no result": ("answered but its actions did not run or gave no verdict",
                  "read the last error above and the service's log (executors that fail, e.g. the Docker engine is "
                  "gone, nodes down, actions cancelled), or fix an image or test command that cannot test a "
                  "response (exit 126, 127, pytest's 4 and 5) or a reward model with no usable score"),
}


class TangramServiceDown(RuntimeError):
    """The service kept failing (``max_consecutive_failures`` in a row, and for a while): the training stops."""


@dataclass(slots=True)
class _Streak:
    """The failures in a row of one service in this process, since its last verdict."""

    n: int = 0
    reached_at: float | None = None  # when n reached the setting
    causes: Counter = field(default_factory=Counter)


_streaks: dict[str, _Streak] = {}  # service URL -> its failures in a row, in this process
_tripped: str | None = None   # why this process tripped
_told = False                 # the tangram_metrics actor (the trainer's process) knows it


def service_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (what a call raised once its retries were spent) says the service is down
    rather than something about the request."""
    return isinstance(exc, TangramHTTPError) and (exc.status == 0 or exc.status >= 500
                                                  or exc.status in _DOWN_STATUSES)


def cause_of(exc: TangramHTTPError) -> str:
    """The :data:`CAUSES` key of a :func:`service_failure`."""
    if exc.status == 0:
        return "stalled" if exc.timed_out else "unreachable"
    if exc.status in (401, 403):
        return "token"
    if exc.status == 429 or (exc.status == 503 and exc.retry_after_s is not None):  # refused for now, too long
        return "full"
    return "5xx"


def did_not_run(r: ActionResult, kind: str) -> str | None:
    """Why an action the service answered did not run (None: it ran). ``kind``: exec, http or model. An
    exec ran when it has an exit code (an executor's own timeout kills the command and reports its exit
    status; a timeout without one is the service's safety net giving up on an executor that never
    ended the run, as under a stalled Docker Engine); an http call when the service made it (its output
    holds the upstream's status, None if unreachable); a model call when it succeeded."""
    ran = {"exec": r.exit_code is not None or r.status == "succeeded",
           "http": r.status != "cancelled" and (r.status != "failed" or isinstance(r.output, dict)),
           "model": r.ok}.get(kind, True)
    return None if ran else f"{r.status}: {r.error or 'no reason given'}"


def _url(settings: TangramSettings) -> str:
    return settings.url.rstrip("/")


def verdict(settings: TangramSettings) -> None:
    """An action of ``settings.url`` ran and gave a verdict: its count starts again."""
    _streaks.pop(_url(settings), None)


def count(settings: TangramSettings) -> int:
    """The failures in a row of ``settings.url`` in this process."""
    s = _streaks.get(_url(settings))
    return s.n if s else 0


def window_s(settings: TangramSettings) -> float:
    """How long failures must keep coming after the count reached the setting: ``retry_s``, at least
    :data:`MIN_WINDOW_S`."""
    return max(float(settings.retry_s or 0.0), MIN_WINDOW_S)


def reported(exc: BaseException) -> bool:
    """Whether this module has counted (or judged) ``exc`` already."""
    return bool(getattr(exc, _REPORTED, False))


def mark(exc: BaseException) -> None:
    try:
        setattr(exc, _REPORTED, True)
    except AttributeError:  # an exception type with slots
        pass


async def failed(settings: TangramSettings, exc: BaseException, what: str) -> None:
    """A call (``what``) to ``settings.url`` raised ``exc`` once its retries were spent: count it when it
    is a :func:`service_failure` (another error says nothing about the service: the count stays)."""
    if service_failure(exc):
        await _count(settings, cause_of(exc), what, str(exc))


async def no_result(settings: TangramSettings, why: str, what: str) -> None:
    """An action (``what``) the service answered did not run or gave no verdict (``why``): count it."""
    await _count(settings, "no result", what, why)


async def _count(settings: TangramSettings, cause: str, what: str, error: str) -> None:
    url = _url(settings)
    s = _streaks.setdefault(url, _Streak())
    s.n += 1
    s.causes[cause] += 1
    limit = int(settings.max_consecutive_failures or 0)
    if not limit or s.n < limit:
        return
    now = _clock()
    if s.reached_at is None:
        s.reached_at = now
    if now - s.reached_at < window_s(settings):
        return  # one burst does not stop a run: failures must keep coming
    await trip(_reason(url, s, settings, limit, now, cause, what, error))


def _reason(url: str, s: _Streak, settings: TangramSettings, limit: int, now: float, cause: str, what: str,
            error: str) -> str:
    causes = ", ".join(f"{CAUSES[c][0]} ({n})" for c, n in s.causes.most_common())
    todo = " ".join(f"{CAUSES[c][0][0].upper()}{CAUSES[c][0][1:]}: {CAUSES[c][1]}."
                    for c in [cause, *(c for c in s.causes if c != cause)])
    return (f"tangram service {url}: {s.n} calls in a row failed, the last {now - s.reached_at:.0f} s after "
            f"the count reached {limit} with no verdict between (retry_s={settings.retry_s:g}); the service "
            f"{causes}; the last, {what}: {error}. On verl's default path every group that needs the service "
            f"would be dropped from now on (or refilled, without end) instead of trained on, so the training "
            f"stops. {todo} Then resume from the last checkpoint. "
            f"custom.tangram.max_consecutive_failures (now {limit}; 0 or null: never) sets how many failures in "
            f"a row, going on for retry_s (at least {MIN_WINDOW_S:g} s) more, stop a run")


async def trip(reason: str) -> None:
    """Record that the run must stop (the first reason wins): in this process, and in the named Ray
    actor the trainer's process reads; a failed Ray call is made again at the next trip."""
    global _tripped, _told
    if _tripped is None:
        _tripped = reason
        log.error("tangram: stopping the training: %s", reason)
    ray = metrics._ray()
    if _told or ray is None:
        return
    for _ in range(2):  # a handle from an earlier Ray session fails once, then is looked up again
        try:
            await metrics._get_actor(ray, create=True).trip.remote(_tripped)
            _told = True
            return
        except Exception:  # noqa: BLE001 - say so below; this process still knows
            log.debug("tangram: metrics actor unavailable", exc_info=True)
            metrics._actor = None
    log.warning("tangram: could not tell the trainer's process (the %s actor) to stop; trying again at the "
                "next failure", metrics.ACTOR_NAME)


def tripped() -> str | None:
    """Why the run must stop (this process or any process of the Ray job tripped), or None."""
    if _tripped is not None:
        return _tripped
    ray = metrics._ray()
    if ray is None:
        return None
    for _ in range(2):
        try:
            actor = metrics._get_actor(ray, create=False)
            return None if actor is None else ray.get(actor.tripped.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - never break the trainer over its own check
            log.debug("tangram: metrics actor unavailable", exc_info=True)
            metrics._actor = None
    return None


def check() -> None:
    """Raise :class:`TangramServiceDown` if the run must stop."""
    reason = tripped()
    if reason:
        raise TangramServiceDown(f"tangram: stopping the training: {reason}")


def reset(actor: bool = True) -> None:
    """Forget every count and trip: this process's, and the Ray actor's unless ``actor`` is false (tests;
    a new ``fit``, see :func:`install_hooks`)."""
    global _tripped, _told
    _streaks.clear()
    _tripped, _told = None, False
    ray = metrics._ray() if actor else None
    if ray is not None:
        try:
            handle = metrics._get_actor(ray, create=False)
            if handle is not None:
                ray.get(handle.untrip.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            log.debug("tangram: metrics actor unavailable", exc_info=True)
            metrics._actor = None


def install_trainer_hook() -> bool:
    """Make verl's replay buffer raise :class:`TangramServiceDown` on the poll after a trip: every
    sampling loop of ``ReplayBuffer`` and ``ReplayBufferAsync`` (training and validation) reads the
    rollout's state through ``_sync_metadata_from_transfer_queue``, and checks right after it, before
    it selects a batch. Only where verl's v1 trainer is loaded (the trainer's process: no import here,
    workers never load it); idempotent. Returns whether the hook is in place."""
    mod = sys.modules.get(_REPLAY_BUFFER)
    cls = getattr(mod, "ReplayBuffer", None)
    original: Any = getattr(cls, "_sync_metadata_from_transfer_queue", None)
    if original is None:
        if mod is not None:
            log.warning("tangram: this verl's ReplayBuffer has no _sync_metadata_from_transfer_queue: a service "
                        "that stays down stops the training only when a step is logged")
        return False
    if getattr(original, "_tangram_guard", False):
        return True

    def sync_then_check(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        check()  # after the read: a group that failed on the last straw is seen with the trip
        return out

    sync_then_check.__wrapped__ = original  # type: ignore[attr-defined]
    sync_then_check._tangram_guard = True  # type: ignore[attr-defined]
    cls._sync_metadata_from_transfer_queue = sync_then_check
    return True


_tracking_hooked = False


def install_hooks() -> None:
    """In every process the plugin reaches: once verl's trainer builds its logger (``fit`` starts), forget
    an earlier fit's trip and install the replay-buffer hook (the trainer and its replay buffer are
    loaded by then), and a check after every
    ``Tracking.log`` (through :mod:`~integrations.verl.metrics`' hook: a step's metrics, its
    ``tangram/failed`` included, are logged first; this also covers the legacy trainer and a custom
    sampler that reads the rollout otherwise). Idempotent."""
    global _tracking_hooked
    install_trainer_hook()
    metrics.install_logger_hook()
    if check not in metrics.AFTER_LOG:
        metrics.AFTER_LOG.append(check)
    if _tracking_hooked:
        return
    from verl.utils.tracking import Tracking

    original_init = Tracking.__init__

    def init_then_hook(self: Any, *args: Any, **kwargs: Any) -> None:
        # a new fit: forget an earlier fit's trip, which the named actor keeps for the whole Ray job. No
        # trip of this fit can be lost so: verl (0.9.1) builds the logger before it sends a prompt to the
        # rollout -- first thing in fit (v1 trainer_base.py, legacy ray_trainer.py, the one-step-off and
        # separation trainers), in __init__ for the fully async trainer, which main builds before its
        # rollouter; init() before fit loads a checkpoint's in-flight prompts but sends them from fit
        reset()
        install_trainer_hook()
        original_init(self, *args, **kwargs)

    init_then_hook.__wrapped__ = original_init  # type: ignore[attr-defined]
    Tracking.__init__ = init_then_hook
    _tracking_hooked = True
