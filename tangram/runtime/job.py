"""What the runtime keeps of one submitted action while it is queued or running (:class:`Job`)."""
from __future__ import annotations

import asyncio

from tangram.core.model import Action
from tangram.runtime.actions import ActionOutcome
from tangram.runtime.environments import Environment


class Job:
    """Runtime-side state of one submitted action (what listeners are handed)."""

    __slots__ = ("action", "kind", "received_at", "enqueued_at", "held_s", "task", "done", "outcome", "env", "requeues",
                 "stopping", "cancelling")

    def __init__(self, action: Action, kind: str, received_at: float, env: Environment | None, held_s: float = 0.0):
        self.action = action
        self.kind = kind
        self.received_at = received_at
        self.enqueued_at = received_at
        self.held_s = max(held_s, 0.0)  # waited for its turn before submit (the service's gate): queueing too
        self.task: asyncio.Task | None = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.outcome: ActionOutcome | None = None
        self.env = env
        self.requeues = 0  # upstream 429s absorbed for this action
        self.stopping: list[asyncio.Task] = []  # its runs a restart stopped, until they are gone
        self.cancelling = False  # a cancel reached its run: a restart meanwhile is cancelled too
