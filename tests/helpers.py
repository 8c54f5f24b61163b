"""Small builders for policy and engine tests (DESIGN.md §8)."""
from __future__ import annotations

import heapq
import os
from typing import NoReturn

import pytest

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


# where each optional dependency of the tests comes from (scripts/test.sh installs them all)
INSTALL = {
    "torch": "pip install -r scripts/test-requirements-torch.txt",
    "verl": "pip install -r scripts/test-requirements.txt",
    "ray": "pip install -r scripts/test-requirements.txt",
    "sklearn": "pip install -e '.[profiling]'",
    "optuna": "pip install -e '.[profiling]'",
    "docker": "pip install -e '.[docker]'",
    "pyarrow": "pip install -e '.[datasets]'",
    "bashlex": "pip install -e '.[datasets]'",
}


def install_hint(module: str) -> str:
    return INSTALL.get(module.split(".")[0], "pip install -r scripts/test-requirements.txt")


def missing(what: str, install: str, *, detail: str = "") -> NoReturn:
    """Skip because ``what`` is missing, naming how to get it; under ``CI=true`` fail instead.

    CI runs scripts/test.sh on a fresh machine, which installs every optional
    dependency and starts a Docker Engine: there a missing one is a broken
    set-up, and a test that silently skips would hide it.
    """
    why = f"{what} is missing ({install})" + (f": {detail}" if detail else "")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {why}; a missing optional dependency is a failure in CI, not a skip", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def drive(eng, clock, arrivals, seconds_of):
    """Submit ``arrivals`` [(time, action)] on a virtual ``clock`` (an object with a settable ``t``),
    completing each started action ``seconds_of(started)`` after it starts, in event order."""
    events: list = []
    seq = 0

    def run(started):
        nonlocal seq
        for s in started:
            seq += 1
            heapq.heappush(events, (clock.t + seconds_of(s), seq, s.action.id))

    for t, a in arrivals:
        while events and events[0][0] <= t:
            clock.t, _, done = heapq.heappop(events)
            run(eng.complete(done))
        clock.t = t
        run(eng.submit(a))
    while events:
        clock.t, _, done = heapq.heappop(events)
        run(eng.complete(done))


def one_node_snapshot(waiting, *, cores=16, running=(), upcoming=None, params=None):
    """A policy snapshot of one node ``n0`` (``cores`` cores, memory to spare) with ``running``'s
    ``(seconds left, units)`` on its cores."""
    from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot

    used = sum(u for _, u in running)
    pools = {"cpu@n0": PoolState("cpu@n0", "cpu", "n0", cores, cores - used),
             "mem@n0": PoolState("mem@n0", "mem", "n0", 10_000, 10_000)}
    return Snapshot(pools=pools, nodes=("n0",), waiting=tuple(waiting),
                    running={"cpu@n0": tuple(running)} if running else {},
                    upcoming=upcoming or {}, params=params or PolicyParams())


def _process_table() -> dict[int, tuple[int, str, str, int]]:
    """pid -> (parent pid, state, command line, start time in clock ticks), read from /proc
    (Linux, as the suite); the start time tells a pid's reuse by another process apart."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").replace("\0", " ")
        except OSError:  # it exited while we read
            continue
        table[int(name)] = (int(fields[1]), fields[0], cmdline, int(fields[19]))
    return table


def processes_using(path: str) -> set[tuple[int, int]]:
    """``(pid, start time)`` of the live processes whose command line names ``path``, with all
    their descendants (Ray's workers name no temp dir but are the raylet's children)."""
    table = _process_table()
    found = {pid for pid, (_, state, cmd, _) in table.items() if path in cmd and state != "Z" and pid != os.getpid()}
    todo = list(found)
    while todo:
        parent = todo.pop()
        for pid, (ppid, state, _, _) in table.items():
            if ppid == parent and state != "Z" and pid not in found:
                found.add(pid)
                todo.append(pid)
    return {(pid, table[pid][3]) for pid in found}


def _still_running(users: set[tuple[int, int]]) -> list[int]:
    table = _process_table()
    return sorted(pid for pid, started in users
                  if (t := table.get(pid)) is not None and t[1] != "Z" and t[3] == started)


def ray_shutdown(cluster=None):
    """What stops a test's Ray: the driver's connection, then the cluster's processes if it made one."""
    def stop() -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return stop


def stop_ray_and_remove(path: str, shutdown, *, timeout_s: float = 30.0) -> None:
    """Shut Ray down and remove its temp root only once every process that used it has exited:
    an exiting process can still write into it (a Ray session folder was once left behind after
    CI, its fixture having removed the root right after ``ray.shutdown()``)."""
    import shutil
    import time

    users = processes_using(path)
    try:
        shutdown()
    finally:
        deadline = time.monotonic() + timeout_s
        while (left := _still_running(users)) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(path, ignore_errors=True)
    assert not left, f"Ray processes still running {timeout_s:.0f} s after shutdown: {left}"
    assert not os.path.exists(path), f"{path} written again after its removal"


def transfer_queue_session(prefix: str):
    """Ray and TransferQueue as verl's trainer starts them (main_ppo: ``tq.init(config.transfer_queue)``;
    workers attach to it), for a module fixture to yield from; stopped and removed afterwards."""
    import contextlib
    import tempfile

    @contextlib.contextmanager
    def session():
        ray = pytest.importorskip("ray")
        tq = pytest.importorskip("transfer_queue", reason="the default path needs transferqueue (verl[verl-core])")
        if ray.is_initialized():
            ray.shutdown()
        tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's unix socket paths
        # a shared test machine: other processes' memory must not make Ray kill TransferQueue's actors
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        # logical CPUs: TransferQueue's controller and storage unit take one each
        ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
                 object_store_memory=100_000_000)
        try:
            from omegaconf import OmegaConf

            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
            yield tq
        finally:
            try:
                tq.close()
            finally:
                stop_ray_and_remove(tmp, ray_shutdown())
    return session()
