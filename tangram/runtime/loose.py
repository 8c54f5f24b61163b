"""Trajectories named by actions outside any environment (``trajectory`` on http and model actions).

An environment's trajectory closes with the environment (DELETE, TTL). A trajectory that only calls
APIs or models has no such end, so the engine's books of it (its generation, for the order's
``generation_credit``; ``tangram/core/generating.py``) are kept for the ``limit`` last named and
forgotten past it, least recently named first, never while an action of it is in the engine. Such a
trajectory holds no node and no memory (``build_action`` refuses cpu and mem_mb beside it), so
forgetting it frees nothing and runs no scheduling round.
"""
from __future__ import annotations

from collections import OrderedDict

from tangram.core.generating import Generating

# 8x the 8,192 live trajectories of a 1,024-prompt x 8-sample rollout: a step's trajectories outlive it
MAX_LOOSE_TRAJECTORIES = 65_536


class LooseTrajectories:
    def __init__(self, books: Generating, limit: int = MAX_LOOSE_TRAJECTORIES):
        self._books, self.limit = books, limit
        self._seen: OrderedDict[str, None] = OrderedDict()
        # a rollout's name from before it had an environment -> that environment (the last ``limit``; one
        # whose environment is gone names the gone id, whose books are then loose, and bounded, too)
        self.aliases: OrderedDict[str, str] = OrderedDict()

    def name(self, trajectory: str | None) -> str | None:
        """The trajectory an action naming ``trajectory`` belongs to: its environment, once it has one."""
        return self.aliases.get(trajectory, trajectory) if trajectory is not None else None

    def adopt(self, trajectory: str, env_id: str) -> None:
        """``trajectory``, named by calls before its rollout had an environment, is ``env_id`` from now on:
        its ended calls and generation move there, and later calls naming it are the environment's."""
        self.aliases[trajectory] = env_id
        self.aliases.move_to_end(trajectory)
        while len(self.aliases) > self.limit:
            self.aliases.popitem(last=False)
        self._books.renamed(trajectory, env_id)
        if not self._books.busy(trajectory):  # a call still in flight ends under the old name: kept bounded
            self._seen.pop(trajectory, None)

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, trajectory: str) -> None:
        self._seen[trajectory] = None
        self._seen.move_to_end(trajectory)
        for _ in range(len(self._seen)):  # one pass at most: busy ones go to the back
            if len(self._seen) <= self.limit:
                return
            oldest = next(iter(self._seen))
            if self._books.busy(oldest):
                self._seen.move_to_end(oldest)
                continue
            del self._seen[oldest]
            self._books.closed(oldest)
