"""Start-up reconciliation and environment leases, over :mod:`tangram.service.state`.

On start, before the first request:

1. every recorded environment whose directory (local) or container (Docker,
   labelled with this state's owner id) still exists is reattached on the node
   its record names: same id, same files, pinned to that node with its memory
   reserved there, next action runs in it; one that never ran an action (on a
   service of several nodes it exists on none yet) is registered again as it was;
2. everything the executors own without a record is removed (directories
   under the node's work root, owned containers; the local executor sweeps the
   cgroups of dead services itself, and a sandboxed command dies with the
   service that ran it: bubblewrap's ``--die-with-parent``);
3. actions recorded without an outcome are answered ``failed`` with
   ``retryable: true``: the service died while they waited or ran, and they
   may be resubmitted (with the same ``Idempotency-Key`` they would not be
   run twice by a live service, but a dead one cannot say whether they ran).

Leases: an environment not used (no action, no renew) for ``env_ttl_s`` and
with nothing running is removed by the reaper.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
from typing import Any

from tangram.service.state import StateStore

log = logging.getLogger("tangram.service")
RESTARTED = "the service restarted while this action was waiting or running; it may be resubmitted"


def default_state_dir(cfg: Any) -> str:
    """Where ``tangram serve`` keeps its state when none is configured:
    ``${XDG_STATE_HOME:-~/.local/state}/tangram/<key>``, ``<key>`` a hash of this host's name and the
    resources it manages (CPU nodes: name, executor, endpoint, workdir; GPU nodes and API pools: names).
    Not of the port or the config file's path: a restart on another port, or with the file moved, finds
    its environments again; a second service on the same nodes finds the directory held and is refused
    (it would book the same cores twice). The host name keeps two machines sharing a home directory
    apart; the GPU nodes and API pools keep services without CPU nodes apart."""
    managed = {"host": socket.gethostname(),
               "cpu": [[n.name, n.executor, n.endpoint, n.workdir] for n in cfg.cpu_nodes],
               "gpu": [n.name for n in cfg.gpu_nodes], "api": [p.name for p in cfg.api_pools]}
    key = hashlib.sha256(json.dumps(managed, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(root, "tangram", key)


def durable_config(cfg: Any) -> Any:
    """Local nodes without a workdir keep their environments under the state directory (stable across starts)."""
    root = cfg.service.state_dir
    if root is None:
        return cfg
    nodes = tuple(dataclasses.replace(n, workdir=os.path.join(root, "envs", n.name))
                  if n.executor == "local" and n.workdir is None else n for n in cfg.cpu_nodes)
    return dataclasses.replace(cfg, cpu_nodes=nodes)


async def reconcile(store: StateStore, rt: Any) -> dict[str, int]:
    """Reattach, sweep, fail in-flight actions; returns the counts (logged)."""
    rt.keep_environments = store.directory is not None
    for ex in rt.env_executors.values():  # an owner that outlives this run: only a state directory gives one
        if store.directory is not None:
            ex.set_owner(store.service_id)
    nodes = list(rt.env_executors)
    adopted: set[str] = set()
    dropped = unplaced = 0
    for rec in list(store.environments()):
        node = rec["node"] or (nodes[0] if len(nodes) == 1 else None)
        if node is None:  # several nodes, and it never ran an action: it exists on none yet, made with its first
            rt.env_registry.adopt(rec["id"], image=rec["image"], memory_mb=rec["memory_mb"], labels=rec["labels"],
                                  node=None, network=rec["network"])
            unplaced += 1
            continue
        ex = rt.env_executors.get(node)
        ok = False
        if ex is not None:
            try:
                ok = await ex.adopt_environment(rec["id"], memory_mb=rec["memory_mb"], network=rec["network"])
            except Exception:  # noqa: BLE001 - an engine down at start: the environment is lost, say so
                log.exception("reattaching environment %s failed", rec["id"])
        if ok:
            rt.env_registry.adopt(rec["id"], image=rec["image"], memory_mb=rec["memory_mb"], labels=rec["labels"],
                                  node=node, network=rec["network"])
            adopted.add(rec["id"])
            try:  # pinned to its node, its memory reserved there, as its first action had done
                rt.engine.place_trajectory(rec["id"], node, rec["memory_mb"])
            except Exception as exc:  # noqa: BLE001 - e.g. the node's memory shrank in the config
                log.warning("environment %s: not pinned to %s (%s); its next action may run elsewhere",
                            rec["id"], node, exc)
        else:
            store.drop_environment(rec["id"])
            dropped += 1
    swept = 0
    for ex in rt.env_executors.values():
        try:
            swept += len(await ex.sweep_unrecorded(adopted))
        except Exception:  # noqa: BLE001
            log.exception("sweeping unrecorded environments failed")
    failed = store.fail_in_flight(RESTARTED)
    rt.env_registry.on_created = lambda env, node: store.set_environment_node(env.id, node)
    counts = {"reattached": len(adopted), "not_yet_placed": unplaced, "lost": dropped, "swept": swept,
              "failed_in_flight": len(failed)}
    if any(counts.values()):
        log.warning("state %s: %s", store.directory, counts)
    return counts


async def reap_idle(store: StateStore, rt: Any, ttl_s: float) -> list[str]:
    """Remove environments idle past ``ttl_s`` with nothing running."""
    now = time.time()
    gone = []
    for env in rt.environments():
        last = store.last_used(env.id)
        if last is not None and not env.active and now - last > ttl_s:
            try:
                await rt.delete_environment(env.id)
            except Exception:  # noqa: BLE001 - deleted meanwhile
                continue
            store.drop_environment(env.id)
            gone.append(env.id)
    if gone:
        log.info("reclaimed %d environments idle for more than %g s", len(gone), ttl_s)
    return gone


async def reaper(store: StateStore, rt: Any, ttl_s: float) -> None:
    period = max(0.05, min(60.0, ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await reap_idle(store, rt, ttl_s)
        except Exception:  # noqa: BLE001 - keep reaping
            log.exception("environment reaper failed")
