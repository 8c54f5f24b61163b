"""The model runner of one GPU node, the same for a local torch executor and a remote (Ray) host.

The manager keeps the books (which service is resident on which chunk);
the host holds the state (device memory). For each action the runner asks
the manager for its cache decision (evict these, restore that), has the
host carry it out, and only after a successful run confirms the restore in
the books, so a failed or cancelled restore is never counted as resident.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

from tangram.core.grants import CacheDecision
from tangram.core.model import Action
from tangram.executors.base import SUCCEEDED, ExecResult, Placement

# what a model action's payload hands to the host (``exec_s``: a simulated host's run time)
PAYLOAD_FIELDS = ("model", "op", "inputs", "tokens", "exec_s")


class ModelHost(Protocol):
    """Carries out a cache decision and runs the batch (TorchGpuExecutor, a Ray host's proxy)."""

    async def execute(self, decision: CacheDecision, payload: Mapping[str, Any], *,
                      timeout_s: float | None = None) -> ExecResult: ...


class GpuRunner:
    """``run(action, placement)`` for one GPU node: lease from the books, execute on the host, confirm."""

    def __init__(self, manager: Any, host: ModelHost, pool: str):
        self.manager = manager
        self.host = host
        self.pool = pool

    async def run(self, action: Action, placement: Placement, *, timeout_s: float | None = None) -> ExecResult:
        decision = self.manager.lease(self.pool, action.id)
        if decision is None:
            raise RuntimeError(f"{action.id} holds no lease on {self.pool}")
        p = action.payload
        payload = {k: p[k] for k in PAYLOAD_FIELDS if k in p}
        res = await self.host.execute(decision, payload, timeout_s=timeout_s)
        if res.status == SUCCEEDED and res.restored:
            # only now is the service resident in the books (a cancelled restore is forgotten by `end`)
            self.manager.restored(self.pool, action.id, res.restore_s)
        return res

    async def close(self) -> None:
        close = getattr(self.host, "close", None)
        if close is not None:
            r = close()
            if hasattr(r, "__await__"):
                await r
