"""Buddy chunks of a GPU node: placements, splits, merges, fragmentation.

The allocator must agree with the policy's packing model
(:func:`tangram.policy.arrange.packable`, used by ``ChunkOperator``): what
the DP thinks fits is exactly what the engine can place.
"""
from __future__ import annotations

import itertools
import random

import pytest

from tangram.managers.gpu import BuddyAllocator, Chunk
from tangram.policy.arrange import ChunkOperator, arrange, packable

C = Chunk


def run_ops(alloc: BuddyAllocator, ops):
    """Apply ``("a", size[, prefer])`` / ``("r", chunk)`` ops; return their results."""
    out = []
    for op in ops:
        if op[0] == "a":
            out.append(alloc.allocate(op[1], op[2] if len(op) > 2 else None))
        else:
            out.append(alloc.release(op[1]))
        alloc.check()
    return out


# (num_gpus, ops, expected results, expected free chunks afterwards)
SCENARIOS = [
    # a fresh node is one level-3 chunk
    (8, [], [], [C(0, 8)]),
    # one GPU splits 8 -> 4+2+1+1 and takes the lowest
    (8, [("a", 1)], [C(0, 1)], [C(1, 1), C(2, 2), C(4, 4)]),
    # the next GPU takes the free buddy (smallest fit), not a split of the 2 or the 4
    (8, [("a", 1), ("a", 1)], [C(0, 1), C(1, 1)], [C(2, 2), C(4, 4)]),
    # two GPUs land on the free 2-chunk, leaving the 4 intact for a later 4-GPU action
    (8, [("a", 1), ("a", 2)], [C(0, 1), C(2, 2)], [C(1, 1), C(4, 4)]),
    # a 4 after a 1 goes to the untouched upper half
    (8, [("a", 1), ("a", 4)], [C(0, 1), C(4, 4)], [C(1, 1), C(2, 2)]),
    # the whole node for one action, then nothing else fits
    (8, [("a", 8), ("a", 1)], [C(0, 8), None], []),
    # releasing the only chunk merges all the way back to the root
    (8, [("a", 1), ("r", C(0, 1))], [C(0, 1), True], [C(0, 8)]),
    # release is idempotent: the second one is a no-op that says so
    (8, [("a", 2), ("r", C(0, 2)), ("r", C(0, 2))], [C(0, 2), True, False], [C(0, 8)]),
    # releasing a chunk that was never handed out changes nothing
    (8, [("a", 2), ("r", C(2, 2))], [C(0, 2), False], [C(2, 2), C(4, 4)]),
    # merges cascade only as far as buddies are free: 1@1 stays held, 1@0 cannot merge
    (8, [("a", 1), ("a", 1), ("a", 2), ("r", C(0, 1)), ("r", C(2, 2))],
     [C(0, 1), C(1, 1), C(2, 2), True, True], [C(0, 1), C(2, 2), C(4, 4)]),
    # fragmentation: 4 free GPUs scattered as 1+1+2 cannot host a 4, though 4 are free
    (8, [("a", 1), ("a", 1), ("a", 1), ("a", 1), ("a", 4), ("r", C(1, 1)), ("r", C(2, 1)), ("a", 4)],
     [C(0, 1), C(1, 1), C(2, 1), C(3, 1), C(4, 4), True, True, None], [C(1, 1), C(2, 1)]),
    # ... and the smallest-fit rule avoids it: two 1s share a 2-chunk, a 2 takes the other half
    (8, [("a", 1), ("a", 2), ("a", 1), ("a", 4)], [C(0, 1), C(2, 2), C(1, 1), C(4, 4)], []),
    # 6 GPUs: roots 4@0 and 2@4, never merged into a (nonexistent) 8
    (6, [], [], [C(0, 4), C(4, 2)]),
    # on 6 GPUs an 8 never fits, a 2 prefers the 2-root over splitting the 4
    (6, [("a", 8), ("a", 2)], [None, C(4, 2)], [C(0, 4)]),
    # 6 GPUs: releasing inside the 2-root merges back to it and stops there
    (6, [("a", 1), ("r", C(4, 1))], [C(4, 1), True], [C(0, 4), C(4, 2)]),
    # 3 GPUs: roots 2@0 and 1@2; a single GPU goes to the 1-root first
    (3, [("a", 1), ("a", 1)], [C(2, 1), C(0, 1)], [C(1, 1)]),
    # 16 GPUs: two level-3 roots, never merged into a 16
    (16, [("a", 8), ("a", 8), ("r", C(0, 8)), ("r", C(8, 8))], [C(0, 8), C(8, 8), True, True], [C(0, 8), C(8, 8)]),
    # zero GPUs: nothing ever fits
    (0, [("a", 1)], [None], []),
    # affinity: among equal 1-chunks, the preferred one (service resident on GPU 3) wins
    (8, [("a", 1), ("a", 2), ("a", 1), ("r", C(1, 1)), ("a", 1, [C(3, 1)])],
     [C(0, 1), C(2, 2), C(1, 1), True, C(1, 1)], [C(4, 4)]),
    # affinity on a split: the half holding GPU 6 is kept, the others stay free
    (8, [("a", 4), ("a", 1, [C(6, 1)])], [C(0, 4), C(6, 1)], [C(4, 2), C(7, 1)]),
    # affinity never beats size: a preferred 4-chunk loses to a plain 1-chunk
    (8, [("a", 1), ("a", 1, [C(4, 4)])], [C(0, 1), C(1, 1)], [C(2, 2), C(4, 4)]),
    # a scored preference (callable): the higher score wins among equal sizes
    (8, [("a", 1), ("a", 1), ("a", 2), ("a", 1), ("a", 1), ("a", 2), ("r", C(0, 1)), ("r", C(5, 1)),
         ("a", 1, lambda c: 2.0 if c.start >= 4 else 1.0)],
     [C(0, 1), C(1, 1), C(2, 2), C(4, 1), C(5, 1), C(6, 2), True, True, C(5, 1)], [C(0, 1)]),
]


@pytest.mark.parametrize("num_gpus, ops, results, free", SCENARIOS)
def test_scenarios(num_gpus, ops, results, free):
    alloc = BuddyAllocator(num_gpus)
    assert run_ops(alloc, ops) == results
    assert alloc.free_chunks() == free
    assert alloc.free_devices == sum(c.size for c in free)


@pytest.mark.parametrize("bad", [0, 3, 5, 16, -1])
def test_size_must_be_a_chunk_size(bad):
    # asking for a non-power-of-two is a bug, not "does not fit"
    with pytest.raises(ValueError):
        BuddyAllocator(8).allocate(bad)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8"])
def test_num_gpus_validated(bad):
    with pytest.raises(ValueError):
        BuddyAllocator(bad)


def test_chunks_are_aligned_and_buddies_pair_up():
    assert C(4, 2).buddy() == C(6, 2)
    assert C(6, 2).buddy() == C(4, 2)
    assert C(0, 8).devices == range(0, 8)
    assert C(3, 1).end == 4


def test_random_churn_keeps_invariants_and_merges_back():
    rng = random.Random(7)
    for n in (1, 2, 3, 6, 8, 16):
        alloc = BuddyAllocator(n)
        held: list[Chunk] = []
        for _ in range(400):
            if held and rng.random() < 0.45:
                c = held.pop(rng.randrange(len(held)))
                assert alloc.release(c)
            else:
                c = alloc.allocate(rng.choice((1, 2, 4, 8)))
                if c is not None:
                    assert all(c.end <= h.start or h.end <= c.start for h in held), "overlapping grants"
                    held.append(c)
            alloc.check()
        for c in held:
            alloc.release(c)
        assert alloc.free_chunks() == BuddyAllocator(n).free_chunks()


# --------------------------------------------------------------------------- #
# the allocator agrees with the policy's packing model


def _fragment(rng: random.Random, n: int):
    """A random reachable state of a node, as a factory that rebuilds it (replaying the same ops)."""
    ops = []
    alloc = BuddyAllocator(n)
    held: list[Chunk] = []
    for _ in range(rng.randrange(0, 12)):
        if held and rng.random() < 0.4:
            c = held.pop(rng.randrange(len(held)))
            alloc.release(c)
            ops.append(("r", c))
        else:
            size = rng.choice((1, 1, 2, 4))
            c = alloc.allocate(size)
            ops.append(("a", size))
            if c is not None:
                held.append(c)

    def fresh() -> BuddyAllocator:
        twin = BuddyAllocator(n)
        run_ops(twin, ops)  # the allocator is deterministic, so this is the same state
        assert twin.free_chunks() == alloc.free_chunks()
        return twin

    return alloc, fresh


def _places(alloc_factory, order) -> bool:
    alloc = alloc_factory()
    return all(alloc.allocate(r) is not None for r in order)


def test_packable_iff_largest_first_iff_some_order():
    rng = random.Random(2024)
    verdicts = []
    for trial in range(300):
        n = rng.choice((2, 4, 6, 8, 8, 8, 16))
        alloc, fresh = _fragment(rng, n)
        free = [c.size for c in alloc.free_chunks()]
        k = rng.randrange(1, 6)
        reqs = [rng.choice((1, 1, 2, 2, 4, 8)) for _ in range(k)]
        verdict = packable(free, reqs)
        assert verdict == _places(fresh, sorted(reqs, reverse=True)), (free, reqs)
        orders = set(itertools.permutations(reqs))
        some = any(_places(fresh, o) for o in orders)
        every = all(_places(fresh, o) for o in orders)
        assert verdict == some, (free, reqs)
        # stronger than asked: best fit places a packable set in any order
        assert verdict == every, (free, reqs)
        verdicts.append(verdict)
    assert 50 < sum(verdicts) < 250  # both answers well exercised


def test_dp_arrangements_are_placeable():
    # whatever ChunkOperator lets the DP choose, the allocator can place (largest first, as the engine does)
    rng = random.Random(11)
    for _ in range(150):
        n = rng.choice((4, 8, 8, 16))
        alloc, fresh = _fragment(rng, n)
        free = [c.size for c in alloc.free_chunks()]
        if not free:
            continue
        cands = []
        for _ in range(rng.randrange(1, 5)):
            t1 = rng.uniform(1, 10)
            cands.append({u: t1 / (u ** rng.uniform(0.3, 1.0)) for u in (1, 2, 4, 8)})
        arr = arrange(cands, ChunkOperator(free))
        if arr is None:
            continue
        assert packable(free, arr.units)
        twin = fresh()
        for u in sorted(arr.units, reverse=True):
            assert twin.allocate(u) is not None, (free, arr.units)
