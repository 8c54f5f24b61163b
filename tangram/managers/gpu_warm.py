"""Warm start: the instances a GPU node loads before its first request.

A static deployment has its models in device memory before the run; an evict-on-execution node
loads each instance when a request first needs it, on that request's path, and on a run's first
step that is most of what it loses to one (docs/results/README.md, "GPU: what the losses to
`static-services` are made of"). A warm start loads, while the node is idle, every model at the
widest DoP first and then narrower ones (8, 4, 2, 1), the largest model first, each aligned chunk
in turn, as long as it fits beside what is already planned: nothing is evicted for it. From then on
the cache is the same evict-on-execution cache: a warm instance is a resident instance.

Why widest first: an idle cluster gives a request the widest chunk (the policy minimises its ACT),
and a wide instance costs the least memory per device; the narrow ones fill what is left, for the
DoPs a queue calls for. Mechanical: :func:`warm_plan` only says what fits; the runtime (and the
simulator) carry the loads out through the manager (:meth:`GpuManager.warm`), each holding its chunk
like an action while it loads; a load whose chunk a request holds waits for the next load to end,
and the warm start ends when none is under way and none can start.
"""
from __future__ import annotations

from typing import Iterable

from tangram.core.grants import Chunk, parse_service, service_name
from tangram.managers.buddy import SIZES
from tangram.managers.service_cache import ModelSpec


def warm_plan(num_gpus: int, memory_mb_per_gpu: int, models: Iterable[ModelSpec],
              resident: Iterable[tuple[str, Chunk]] = ()) -> list[tuple[str, Chunk]]:
    """``(service, chunk)`` to load, in order, on a node of ``num_gpus`` devices of ``memory_mb_per_gpu``
    MiB: widest DoP first, then the largest model (by name on a tie), then the lowest chunk; each one
    only where its per-device share fits beside those before it and the ``resident`` instances (none
    is evicted, none loaded twice)."""
    used = [0] * num_gpus
    have = set()
    specs = {m.name: m for m in models}
    for service, chunk in resident:
        have.add((service, chunk.start, chunk.size))
        model, dop = parse_service(service)
        spec = specs.get(model)
        if spec is not None:
            for d in chunk.devices:
                used[d] += spec.mb_per_device(dop)
    order = sorted(specs.values(), key=lambda m: (-m.state_mb, m.name))
    plan = []
    for dop in sorted((k for k in SIZES if k <= num_gpus), reverse=True):
        for m in order:
            need = m.mb_per_device(dop)
            service = service_name(m.name, dop)
            for start in range(0, num_gpus - dop + 1, dop):
                chunk = Chunk(start, dop)
                if (service, start, dop) in have or any(used[d] + need > memory_mb_per_gpu for d in chunk.devices):
                    continue
                for d in chunk.devices:
                    used[d] += need
                plan.append((service, chunk))
    return plan
