"""Small builders for policy and engine tests (DESIGN.md §8)."""
from __future__ import annotations

from tangram.core.engine import Engine
from tangram.core.model import Action, Elasticity
from tangram.managers.base import CountingManager
from tangram.policy.snapshot import PolicyParams


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_action(id, *, cpu=None, gpu=None, api=None, t1=None, serial=None, cls="default",
                trajectory=None, mem=0, service=None):
    demands = {}
    if cpu is not None:
        demands["cpu"] = cpu
    if gpu is not None:
        demands["gpu"] = gpu
    if api is not None:
        demands[f"api:{api}"] = 1
    elasticity = Elasticity.amdahl(serial) if serial is not None else None
    return Action.build(id, demands, t1_s=t1, elasticity=elasticity, action_class=cls,
                        trajectory=trajectory, mem_mb=mem, service=service)


def make_node(name="n0", *, cores=8, mem=10_000, gpus=0):
    pools = {f"cpu@{name}": cores, f"mem@{name}": mem}
    if gpus:
        pools[f"gpu@{name}"] = gpus
    return pools


def make_engine(*pool_dicts, params=None, clock=None, api=None):
    caps = {}
    for d in pool_dicts:
        caps.update(d)
    for name, slots in (api or {}).items():
        caps[f"api:{name}"] = slots
    clock = clock or FakeClock()
    return Engine([CountingManager(caps)], clock=clock, params=params or PolicyParams()), clock
