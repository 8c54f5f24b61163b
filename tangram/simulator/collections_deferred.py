"""Python's full (oldest-generation) garbage collections, deferred to the end of a simulation.

A simulation keeps about ten GC-tracked objects per action alive until it ends (its records,
the actions, their demands' read-only views, the policy's per-action memos): half a million at
50,000 actions. The collector's oldest generation scans all of them each time it runs, which it
does whenever they have grown by a quarter since the last time: at ``ai-coding`` batch 2,048
(100,882 actions) 17 full collections took ~3 s of a ~28 s run and freed no object (peak
memory was the same without them). The young generations still run as usual, so short-lived
cycles are freed; what reaches the oldest one waits for the first full collection after the
run (Python's own, when it is due: an explicit one here would scan a test process's whole heap
after each of its many small simulations).

Thresholds set inside the block are replaced by those from before it when it ends. The deferral
is the process's, so other threads' full collections wait too. It relies on CPython's
generational collector (3.10-3.13, the versions this project supports): a collector without
that trigger would simply run as it does, the same results, without the gain.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

# gen 1 collections between two full ones: far more than any simulation reaches (~250 at 100k actions)
_NEVER = 1 << 30

# the thresholds are the process's: blocks nested or overlapping in threads share one deferral,
# taken by the first to enter and given back by the last to leave
_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()


@contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Within the block, no full collection runs. The thresholds before it are restored once the
    last block open (nested, or in another thread) is left, an exception's included."""
    global _depth, _saved
    entered = False
    try:
        with _lock:
            if _depth == 0:
                _saved = gc.get_threshold()
                gc.set_threshold(_saved[0], _saved[1], _NEVER)
            _depth += 1
            entered = True
        yield
    finally:
        if entered:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.set_threshold(*_saved)
