"""Memos of what the policy derives from one frozen action, whose entries go when the action does.

The policy reads the same derived data of a waiting action every round (its
demands split per pool, its row of options and durations), so it keeps them in
dicts keyed by ``id(action)``: a plain dict lookup is what the hot loops can
afford. An entry leaves when its action is dispatched (:func:`forget`, called by
``plan``: a started action is not planned again) or, whichever comes first, when
the action is freed (a cancelled or timed-out one): each entry holds a weak
reference to its action whose callback removes it. So a long-running service
holds memos of waiting actions only, however many finished records it keeps,
and an id reused by a later action never finds a stale entry. The size bound is
a backstop for a queue of more waiting actions than it: past it the memo starts
again, as a cache may.
"""
from __future__ import annotations

import weakref
from typing import Callable, Protocol, TypeVar

from tangram.core.model import Action

MEMO_BOUND = 65536  # entries per memo: a backstop, see above


class _Ref(weakref.ref):
    """A weak reference that knows its memo key (a slot: cheaper than ``weakref.KeyedRef``'s Python __new__)."""

    __slots__ = ("key",)


class Entry(Protocol):
    ref: _Ref


E = TypeVar("E", bound=Entry)


def forgetter(memo: dict[int, Entry]) -> Callable[[_Ref], None]:
    """The callback that removes an entry of ``memo`` when its action is freed."""
    def forget(ref: _Ref) -> None:
        # only the entry this reference was made for: the memo may have restarted and a later
        # entry be under the key (the same action, looked up again)
        entry = memo.get(ref.key)
        if entry is not None and entry.ref is ref:
            memo.pop(ref.key, None)
    return forget


def remember(memo: dict[int, E], a: Action, entry: E, forget: Callable[[_Ref], None]) -> E:
    """Keep ``entry`` as ``a``'s in ``memo`` until ``a`` is freed (or the memo reaches its bound)."""
    if len(memo) >= MEMO_BOUND:
        memo.clear()
    key = id(a)
    ref = entry.ref = _Ref(a, forget)
    ref.key = key
    memo[key] = entry
    return entry


def forget(memo: dict[int, Entry], a: Action) -> None:
    """Drop ``a``'s entry (its weak reference goes with it, callback and all)."""
    memo.pop(id(a), None)
