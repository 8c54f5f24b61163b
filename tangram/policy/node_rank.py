"""The node a CPU action free to go anywhere goes to, without asking every node.

Candidate selection sends a CPU action free to go to any node (no trajectory bound
to a node, no restriction to some nodes, no GPU) to the node that fits it (its
cores, and the memory it places for its trajectory if any) with the most free
memory, then the most free cores, the earlier node on a tie
(``schedule._node_preference``). Asked node by node, that is every candidate times
every node: at 15 nodes of 256 cores (the paper's testbed) it was most of a round.
The key does not depend on the action, so one ranking, kept as the round's
candidates take units, serves them all: the first node in rank order that fits is
the node the full scan picks.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from tangram.core.pools import pool_name


_NONE: dict = {}  # the entries of a ranking not built (read only)
_NONE_OUT: frozenset = frozenset()


class NodeRank:
    """``nodes`` by (most free memory, most free cores, earliest), over ``free`` (the round's
    free units, which only shrink). Built when asked a second time in a round; :meth:`moved` after
    every candidate placed on a node keeps it current."""

    __slots__ = ("_nodes", "_pools", "_free", "_entries", "_entry", "_out_of_cores", "_asked")

    def __init__(self, nodes: tuple, pools, free) -> None:
        self._nodes, self._pools, self._free = nodes, pools, free
        self._asked = False
        # built on the second ask (most rounds never ask): sorted (-free memory, -free cores, index, node)
        # (None: not built; (): the scan stands, see ranked), node -> its current entry, and the CPU pools
        # with no free core not yet closed by a one-core action
        self._entries: list[tuple] | None = None
        self._entry: dict = _NONE
        self._out_of_cores: set[str] = _NONE_OUT

    def _key(self, node, index: int) -> tuple:
        mname = pool_name("mem", node)
        mem = self._free[mname] if mname in self._pools else 0
        cpu = pool_name("cpu", node)
        cores = self._free[cpu]
        if cores <= 0:
            self._out_of_cores.add(cpu)
        return (-mem, -cores, index, node)

    def ranked(self) -> list[tuple] | None:
        """The entries in rank order (built now if not yet): read the node at ``[3]``. None the first
        time it is asked in a round (one action scans the nodes in about the time the ranking takes
        to build and sort: a round of the simulator places one or two), and where a ranking cannot
        stand in for the scan: a node listed twice (the scan asks it twice), or a CPU pool in chunks
        (a request may fail to pack with units free, so a node the ranking does not reach could
        record a failure the scan reports)."""
        if not self._asked:
            self._asked = True
            return None
        if self._entries is None:
            self._entries, self._entry, self._out_of_cores = [], {}, set()
            for index, node in enumerate(self._nodes):
                cpu = pool_name("cpu", node)
                if cpu not in self._pools:
                    continue  # a node without cores never fits a CPU action
                if node in self._entry or self._pools[cpu].chunks is not None:
                    self._entries = ()
                    return None
                self._entry[node] = entry = self._key(node, index)
                self._entries.append(entry)
            self._entries.sort()
        return self._entries if self._entries != () else None

    def moved(self, node) -> None:
        """``node``'s free units changed (a candidate took some)."""
        old = self._entry.get(node) if self._entries else None
        if old is None:
            return
        new = self._key(node, old[2])
        if new != old:
            entries = self._entries
            del entries[bisect_left(entries, old)]
            insort(entries, new)
            self._entry[node] = new

    def take_out_of_cores(self) -> set[str]:
        """The CPU pools found with no free core since the last call (a one-core action that does not
        reach them in rank order closes them, as the scan does)."""
        out, self._out_of_cores = self._out_of_cores, set()
        return out
