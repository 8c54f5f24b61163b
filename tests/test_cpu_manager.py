"""CPU manager (AOE): exclusive core sets preferring one NUMA domain and
adjacent cores, memory reservations, books, idempotent release, topology
discovery from sysfs / affinity / meminfo, and engine-level leak checks."""
from __future__ import annotations

import os

import pytest

from tangram.core.engine import Engine
from tangram.core.model import Action
from tangram.managers.base import AllocationError
from tangram.managers.cpu import (
    CpuManager,
    CpuNode,
    choose_cores,
    discover_local_node,
    format_cpulist,
    parse_cpulist,
)


def two_socket(name: str = "n0", memory_mb: int = 1000) -> CpuNode:
    # 2 NUMA domains of 4 cores, interleaved ids like many real boxes
    return CpuNode(name, cores=list(range(8)), numa=[[0, 2, 4, 6], [1, 3, 5, 7]], memory_mb=memory_mb)


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpulist([5]) == "5"


@pytest.mark.parametrize("domains, free, units, expected", [
    # one domain, contiguous: lowest run
    ([[0, 1, 2, 3, 4, 5, 6, 7]], set(range(8)), 3, (0, 1, 2)),
    # best-fit run: the 2-run {5,6} is used rather than splitting the 4-run {0..3}
    ([[0, 1, 2, 3, 4, 5, 6, 7]], {0, 1, 2, 3, 5, 6}, 2, (5, 6)),
    # no run long enough: smallest span window, lowest first on ties
    ([[0, 1, 2, 3, 4, 5, 6, 7]], {0, 2, 3, 5, 7}, 3, (0, 2, 3)),
    ([[0, 1, 2, 3, 4, 5, 6, 7]], {0, 3, 4, 6, 7}, 3, (3, 4, 6)),
    # NUMA first: the domain with fewest free cores that still fits (best fit)
    ([[0, 1, 2, 3], [4, 5, 6, 7]], {0, 1, 2, 3, 5, 6}, 2, (5, 6)),
    # a request bigger than the fitting domain's runs stays inside one domain
    ([[0, 2, 4, 6], [1, 3, 5, 7]], set(range(8)), 4, (0, 2, 4, 6)),
    # no domain fits: spans, most free domain first
    ([[0, 1, 2, 3], [4, 5, 6, 7]], {0, 1, 4, 5, 6}, 4, (0, 4, 5, 6)),
    # not enough cores at all
    ([[0, 1]], {0}, 2, None),
])
def test_choose_cores(domains, free, units, expected):
    assert choose_cores(domains, free, units) == expected


@pytest.mark.parametrize("node, field", [
    (CpuNode("", [0]), "nodes[0].name"),
    (CpuNode("a@b", [0]), "nodes[0].name"),
    (CpuNode("n", []), "nodes[0].cores: a node needs at least one core"),
    (CpuNode("n", [0, 0]), "nodes[0].cores: duplicate"),
    (CpuNode("n", [0, -1]), "nodes[0].cores: core ids must be non-negative"),
    (CpuNode("n", [0, 1], numa=[[0]]), "nodes[0].numa: the domains must partition"),
    (CpuNode("n", [0, 1], numa=[[0, 1], []]), "nodes[0].numa[1]: empty"),
    (CpuNode("n", [0], memory_mb=-5), "nodes[0].memory_mb"),
])
def test_bad_node_names_field(node, field):
    with pytest.raises(ValueError) as e:
        CpuManager([node])
    assert field in str(e.value)


def test_duplicate_node():
    with pytest.raises(ValueError, match=r"nodes\[1\].name: node 'n0' configured twice"):
        CpuManager([two_socket(), two_socket()])


def test_allocate_release_books_and_errors():
    m = CpuManager([two_socket(), two_socket("n1")])
    states = {p.name: (p.rtype, p.node, p.capacity, p.free) for p in m.pool_states()}
    assert states == {"cpu@n0": ("cpu", "n0", 8, 8), "mem@n0": ("mem", "n0", 1000, 1000),
                      "cpu@n1": ("cpu", "n1", 8, 8), "mem@n1": ("mem", "n1", 1000, 1000)}
    a = m.allocate("cpu@n0", 2, "a")
    b = m.allocate("cpu@n0", 2, "b")
    assert a == (0, 2) and b == (4, 6)  # same domain, adjacent in that domain
    c = m.allocate("cpu@n0", 4, "c")
    assert c == (1, 3, 5, 7)  # the other domain, whole
    assert m.allocate("mem@n0", 600, "traj") == 600
    with pytest.raises(AllocationError, match="1 cores requested, 0 free"):
        m.allocate("cpu@n0", 1, "d")
    with pytest.raises(AllocationError, match="500 MiB requested, 400 free"):
        m.allocate("mem@n0", 500, "traj2")
    with pytest.raises(AllocationError, match="already holds cores"):
        m.allocate("cpu@n0", 1, "a")
    with pytest.raises(AllocationError, match="unknown pool 'gpu@n0'"):
        m.allocate("gpu@n0", 1, "x")
    with pytest.raises(AllocationError, match="units must be a positive integer"):
        m.allocate("cpu@n1", 0, "x")
    m.check_invariants()
    assert m.held()["cpu@n0"] == {"a": (0, 2), "b": (4, 6), "c": (1, 3, 5, 7)}
    assert m.release("cpu@n0", "b") is True
    assert m.release("cpu@n0", "b") is False  # idempotent
    assert m.release("nope@n0", "b") is False
    assert m.allocate("cpu@n0", 1, "e") == (4,)  # reuses the hole
    for h in ("a", "c", "e"):
        m.release("cpu@n0", h)
    m.release("mem@n0", "traj")
    m.check_invariants()
    assert all(p.free == p.capacity for p in m.pool_states())
    assert all(not hs for hs in m.held().values())


def test_invariant_catches_corruption():
    m = CpuManager([two_socket()])
    m.allocate("cpu@n0", 2, "a")
    m._nodes["n0"].free_cores.add(0)  # a granted core also free: a bug
    with pytest.raises(AssertionError, match="also free"):
        m.check_invariants()


def test_discover_local_node_from_fake_sysfs(tmp_path):
    affinity = sorted(os.sched_getaffinity(0))
    for i, chunk in enumerate([affinity[::2], affinity[1::2]]):
        d = tmp_path / f"node{i}"
        d.mkdir()
        (d / "cpulist").write_text(format_cpulist(chunk) + "\n" if chunk else "\n")
    (tmp_path / "node7").mkdir()
    (tmp_path / "node7" / "cpulist").write_text("1000-1003\n")  # cores we may not use: dropped
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2097152 kB\nMemFree: 1 kB\n")
    node = discover_local_node("me", sysfs=str(tmp_path), meminfo=str(meminfo))
    assert node.name == "me"
    assert list(node.cores) == affinity
    assert [list(d) for d in node.numa] == [d for d in (affinity[::2], affinity[1::2]) if d]
    assert 0 < node.memory_mb <= 2048


def test_discover_real_machine():
    node = discover_local_node()
    assert sorted(node.cores) == sorted(os.sched_getaffinity(0))
    assert node.memory_mb > 0
    CpuManager([node]).check_invariants()


# ---------------------------------------------------------------------- #
# through the engine: cores per action, memory per trajectory, nothing leaks

def test_engine_grants_cores_and_memory_and_leaks_nothing():
    m = CpuManager([two_socket("n0", 1000)])
    eng = Engine([m])
    a1 = Action.build("t1-a", {"cpu": 2}, trajectory="t1", mem_mb=300)
    a2 = Action.build("t2-a", {"cpu": 4}, trajectory="t2", mem_mb=300)
    a3 = Action.build("t3-a", {"cpu": 4}, trajectory="t3", mem_mb=300)
    started = eng.submit(a1) + eng.submit(a2) + eng.submit(a3)
    assert [s.action.id for s in started] == ["t1-a", "t2-a"]
    assert started[0].grants == {"cpu@n0": (0, 2)}
    assert started[1].grants == {"cpu@n0": (1, 3, 5, 7)}
    assert m.held()["mem@n0"] == {"t1": 300, "t2": 300}
    eng.check_invariants()
    # an error, then a timeout: the cores come back, the trajectory memory stays
    assert [s.action.id for s in eng.complete("t2-a", "failed")] == ["t3-a"]
    eng.check_invariants()
    eng.complete("t1-a", "timeout")
    eng.cancel("t3-a")
    eng.check_invariants()
    assert m.held()["cpu@n0"] == {}
    assert m.held()["mem@n0"] == {"t1": 300, "t2": 300, "t3": 300}
    for t in ("t1", "t2", "t3"):
        eng.close_trajectory(t)
    eng.check_invariants()
    assert all(p.free == p.capacity for p in eng.pool_states().values())


def test_managers_and_local_executor_import_no_aiohttp_or_docker():
    import subprocess
    import sys

    code = ("import sys, tangram.managers.basic, tangram.managers.cpu, tangram.executors.local, "
            "tangram.executors.http, tangram.executors.docker, tangram.core.engine; "
            "print(sorted(m for m in ('aiohttp', 'docker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # the executors import their clients lazily
