"""Memos of what the policy derives from one frozen action, whose entries go when the action leaves.

The policy reads the same derived data of a waiting action every round (its
demands split per pool, its row of options and durations), so it keeps them in
dicts keyed by ``id(action)``: a plain dict lookup, with no check of whose the
entry is, is what the hot loops can afford. Two exits keep that sound and small:

* an entry leaves when its action leaves the engine's queue, whatever the reason
  (started, cancelled, failed: the engine calls :func:`drop_entries_of`), so a
  long-running service holds memos of waiting actions only, however many finished
  records it keeps (an action queued again, a requeued 429, has them rebuilt);
* an entry also leaves when its action is freed (one the policy read but the
  engine never queued): it holds a weak reference whose callback removes it. The
  callback is the memo's own ``dict.pop`` bound to the key, C code throughout, so
  no signal or exception can interrupt it; CPython calls it before the action's
  memory is freed, so no later action can find the entry under a reused id.

The size bound is a backstop for more waiting actions than it: past it the memo
starts again, as a cache may (an entry dropped so keeps its callback, which then
pops whatever its action's key holds when the action dies: the dying action's).
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Protocol, TypeVar

from tangram.core.model import Action

MEMO_BOUND = 65536  # entries per memo: a backstop, see above


class Entry(Protocol):
    ref: weakref.ref  # to its action


E = TypeVar("E", bound=Entry)

_MEMOS: list[dict] = []  # every registered memo, for drop_entries_of


def register(memo: dict[int, Entry]) -> dict[int, Entry]:
    """``memo`` (``id(action)`` -> entry), registered for :func:`drop_entries_of`."""
    _MEMOS.append(memo)
    return memo


def remember(memo: dict[int, E], a: Action, entry: E) -> E:
    """Keep ``entry`` as ``a``'s in ``memo`` until ``a`` leaves the queue or is freed."""
    if len(memo) >= MEMO_BOUND:
        memo.clear()
    key = id(a)
    entry.ref = weakref.ref(a, partial(memo.pop, key))  # called with the reference: pop(key, ref)
    memo[key] = entry
    return entry


def drop_entries_of(a: Action) -> None:
    """Drop ``a``'s entries from every memo. Their weak references go with them, callbacks and all,
    unless an entry is held elsewhere: its callback then pops ``a``'s key when ``a`` dies, which
    holds ``a``'s own newer entry or nothing (no other live object has ``a``'s id)."""
    key = id(a)
    for memo in _MEMOS:
        entry = memo.get(key)
        if entry is not None and entry.ref() is a:
            del memo[key]
