"""The service's garbage-collection measures (tangram/service/gc_pauses.py)."""
from __future__ import annotations

import gc

from tangram.service.gc_pauses import PAUSE_BUCKETS, GcPauses, freeze_startup_objects


def _histogram(pauses: GcPauses, generation: int) -> dict[str, float]:
    """The scraped histogram of one generation: bucket bound (and _sum) -> value."""
    hist = next(m for m in pauses.collect() if m.name == "tangram_gc_pause_seconds")
    out = {}
    for s in hist.samples:
        if s.labels.get("generation") != str(generation):
            continue
        out[s.labels.get("le", s.name.rsplit("_", 1)[-1])] = s.value
    return out


def test_each_collection_is_counted_under_its_generation_while_open():
    pauses = GcPauses()
    gc.disable()  # only the collections below: none started by the allocations in between
    try:
        before = _histogram(pauses, 2)
        for _ in range(3):
            gc.collect(2)
        gc.collect(1)
        after = _histogram(pauses, 2)
        gc.enable()
        assert after["+Inf"] - before["+Inf"] == 3
        assert after["sum"] > before["sum"]
        # cumulative: each bound counts the pauses at or under it, +Inf all of them
        bounds = [str(b) for b in PAUSE_BUCKETS] + ["+Inf"]
        assert [after[b] for b in bounds] == sorted(after[b] for b in bounds)
        assert _histogram(pauses, 1)["+Inf"] >= 1
    finally:
        gc.enable()
        pauses.close()
    assert pauses._on_collection not in gc.callbacks
    n = _histogram(pauses, 2)["+Inf"]
    gc.collect(2)
    assert _histogram(pauses, 2)["+Inf"] == n  # closed: no longer counting
    pauses.close()  # twice is harmless


def test_a_pause_lands_in_its_bucket():
    pauses = GcPauses()
    pauses.close()  # feed it by hand: a 3 ms full collection
    pauses._on_collection("start", {"generation": 2})
    pauses._started -= 0.003
    pauses._on_collection("stop", {"generation": 2})
    h = _histogram(pauses, 2)
    assert h["0.001"] == 0 and h["0.005"] == 1 and h["+Inf"] == 1
    assert 0.003 <= h["sum"] < 0.1


def test_frozen_objects_are_no_longer_scanned():
    held = [[i] for i in range(50_000)]  # tracked objects that outlive the freeze
    try:
        frozen = freeze_startup_objects()
        assert frozen >= 50_000 and frozen == gc.get_freeze_count()
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in tracked for x in held[::1000])  # moved out of every generation
        pauses = GcPauses()
        try:
            gauge = next(m for m in pauses.collect() if m.name == "tangram_gc_frozen_objects")
            assert gauge.samples[0].value == frozen
        finally:
            pauses.close()
    finally:
        gc.unfreeze()  # the test process's objects are collected as before
    assert gc.get_freeze_count() == 0
    del held
