"""Stop the training when the Tangram service stays down (``max_consecutive_failures``).

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

How: every call of this integration to the service goes through
:func:`integrations.verl.session.retrying`, which reports its outcome here. A call that failed
after its retries because the service could not be reached, did not answer in time, answered 5xx,
refused the run's token (401, 403) or stayed full past ``admission_wait_s`` (429) --
:func:`service_failure` -- adds one to this process's count for that service; any other answer (a
success, an error about the request itself) resets it. A verdict on a response is a successful
call and never counts. At ``max_consecutive_failures`` (default 32; 0 or null: never) the process
*trips*: it logs the cause at ERROR and records it in the ``tangram_metrics`` Ray actor. The
trainer's process raises :class:`TangramServiceDown` (naming the cause and the setting) the next
time verl's replay buffer reads the rollout's state (every poll of ``ReplayBuffer.sample``, so
before the batch in collection is trained on) and after a step's metrics are logged; nothing in
verl catches it on the way to ``main_ppo``: the run stops. The trainer's process is reached through
the ``verl.plugins`` entry point (``TANGRAM_ENABLED=1``), as for the metrics.

No verl import at module level.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from integrations.verl import metrics
from integrations.verl.config import TangramSettings
from tangram.client import TangramHTTPError

log = logging.getLogger("integrations.verl")

# besides "not reached / no answer in time" (status 0) and any 5xx: the service refuses this run's
# token (401, 403), or stayed full longer than admission_wait_s (429). None of them says anything
# about the request, and each fails every call of the run alike
_DOWN_STATUSES = frozenset({401, 403, 429})
_REPLAY_BUFFER = "verl.trainer.ppo.v1.replay_buffer"


class TangramServiceDown(RuntimeError):
    """The service failed ``max_consecutive_failures`` calls in a row: the training stops."""


_counts: dict[str, int] = {}  # service URL -> its calls that failed in a row, in this process
_tripped: str | None = None   # why this process tripped


def service_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (what a call raised once its retries were spent) says the service is down
    rather than something about the request."""
    return isinstance(exc, TangramHTTPError) and (exc.status == 0 or exc.status >= 500
                                                  or exc.status in _DOWN_STATUSES)


def _url(settings: TangramSettings) -> str:
    return settings.url.rstrip("/")


def answered(settings: TangramSettings) -> None:
    """A call to ``settings.url`` got an answer: its count starts again."""
    _counts.pop(_url(settings), None)


def count(settings: TangramSettings) -> int:
    """The calls to ``settings.url`` that failed in a row in this process."""
    return _counts.get(_url(settings), 0)


async def failed(settings: TangramSettings, exc: BaseException, what: str) -> None:
    """A call (``what``) to ``settings.url`` raised ``exc`` once its retries were spent: count it when
    it is a :func:`service_failure` (else the service answered: the count starts again), and trip at
    ``settings.max_consecutive_failures``."""
    if not service_failure(exc):
        answered(settings)
        return
    url = _url(settings)
    n = _counts[url] = _counts.get(url, 0) + 1
    limit = int(settings.max_consecutive_failures or 0)
    if limit and n >= limit and _tripped is None:
        await trip(f"tangram service {url}: {n} calls in a row failed after their retries (retry_s="
                   f"{settings.retry_s:g}); the last, {what}: {exc}. On verl's default path every group that "
                   "needs the service would be dropped from now on (or refilled, without end) instead of "
                   "trained on, so the training stops: bring the service back and resume from the last "
                   f"checkpoint. custom.tangram.max_consecutive_failures (now {limit}; 0 or null: never) sets "
                   "how many failures in a row stop a run")


async def trip(reason: str) -> None:
    """Record that the run must stop (the first reason wins): in this process, and in the named Ray
    actor the trainer's process reads."""
    global _tripped
    if _tripped is None:
        _tripped = reason
        log.error("tangram: stopping the training: %s", reason)
    ray = metrics._ray()
    if ray is None:
        return
    for _ in range(2):  # a handle from an earlier Ray session fails once, then is looked up again
        try:
            await metrics._get_actor(ray, create=True).trip.remote(reason)
            return
        except Exception:  # noqa: BLE001 - say so below; this process still knows
            log.debug("tangram: metrics actor unavailable", exc_info=True)
            metrics._actor = None
    log.warning("tangram: could not tell the trainer's process (the %s actor) to stop", metrics.ACTOR_NAME)


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
    a new run in the same Ray job)."""
    global _tripped
    _counts.clear()
    _tripped = None
    ray = metrics._ray() if actor else None
    if ray is not None:
        try:
            actor = metrics._get_actor(ray, create=False)
            if actor is not None:
                ray.get(actor.untrip.remote(), timeout=30)
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
    """In every process the plugin reaches: the replay-buffer hook once verl's trainer builds its logger
    (``fit`` starts: the trainer and its replay buffer are loaded by then), and a check after every
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
        install_trainer_hook()
        original_init(self, *args, **kwargs)

    init_then_hook.__wrapped__ = original_init  # type: ignore[attr-defined]
    Tracking.__init__ = init_then_hook
    _tracking_hooked = True
