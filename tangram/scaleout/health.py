"""Health loop: probe every node, report the ones that stop answering and the ones that return.

A probe is an ``async () -> None`` that raises (or does not return within
``timeout_s``) when its node does not answer: a Docker ``/_ping``, a Ray
actor's ``ping``. A node is reported down after ``failures`` consecutive
failed probes (one slow answer on a loaded machine is not a dead node) and
up again after one good probe. Probes of one round run concurrently, so a
hanging endpoint never delays the others' verdicts by more than ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Mapping

log = logging.getLogger("tangram.scaleout.health")

Probe = Callable[[], Awaitable[None]]


class HealthMonitor:
    def __init__(self, probes: Mapping[str, Probe], *, on_down: Callable[[str, str], None],
                 on_up: Callable[[str], None], interval_s: float = 1.0, timeout_s: float = 2.0,
                 failures: int = 2):
        if not interval_s > 0 or not timeout_s > 0 or failures < 1:
            raise ValueError("interval_s and timeout_s must be positive, failures >= 1")
        self.probes = dict(probes)
        self.on_down = on_down
        self.on_up = on_up
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.misses: dict[str, int] = {n: 0 for n in self.probes}
        self.down: set[str] = set()
        self.downs: dict[str, int] = {}  # node -> times marked down: an answer from before the last one is stale
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None and self.probes:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="tangram-health")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for p in self.probes.values():
            close = getattr(p, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort
                    pass

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug in a callback must not stop the loop
                log.exception("health round failed")
            await asyncio.sleep(self.interval_s)

    def mark_down(self, node: str) -> None:
        """``node`` is down (by this loop, by hand, by a broken call): answers already on the way are stale."""
        self.down.add(node)
        self.downs[node] = self.downs.get(node, 0) + 1

    async def check_once(self) -> dict[str, str | None]:
        """One round: probe every node, fire the callbacks; node -> None (ok) or why not."""
        nodes = list(self.probes)
        before = dict(self.downs)
        results = await asyncio.gather(*(self._probe(n) for n in nodes))
        verdict = dict(zip(nodes, results))
        for node, why in verdict.items():
            if why is None:
                if self.downs.get(node, 0) != before.get(node, 0):
                    continue  # marked down while this round waited: its "ok" may predate that failure
                self.misses[node] = 0
                if node in self.down:
                    self.down.discard(node)
                    log.warning("node %s answers again", node)
                    self.on_up(node)
                continue
            self.misses[node] = self.misses.get(node, 0) + 1
            if node not in self.down and self.misses[node] >= self.failures:
                self.mark_down(node)
                log.warning("node %s is down: %s", node, why)
                self.on_down(node, why)
        return verdict

    async def probe(self, node: str) -> str | None:
        """Probe one node now; None if it answered, else why not."""
        return await self._probe(node)

    async def _probe(self, node: str) -> str | None:
        try:
            await asyncio.wait_for(self.probes[node](), self.timeout_s)
            return None
        except asyncio.TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is "not answering"
            return f"{type(exc).__name__}: {str(exc)[:200]}"
