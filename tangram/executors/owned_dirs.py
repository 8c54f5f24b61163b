"""Which directories under a local executor's root this service made (``LocalExecutor``).

A node's ``workdir`` may be a directory that holds other things (a user's projects, another
service's environments), so a restart's sweep may remove only what this service made. Each
environment directory it makes gets a mark, ``<root>/.tangram-owned/<owner>/<env_id>``: beside the
environment, not inside it, so its commands never see it (a file in a repository's working tree
would show in its ``git status`` and could change a test's result). ``owner`` is the state
directory's id (``StateStore.service_id``): two services sharing a workdir sweep only their own.
Without a state directory the service sets no owner: nothing is marked, and nothing is swept at a
start (such a run removes its environments when it stops; a crash leaves them, as it leaves no record).
"""
from __future__ import annotations

import os
import re

MARKS_DIR = ".tangram-owned"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")


class OwnedMarks:
    """The marks of one owner under ``root``; no owner (no durable state): nothing is marked or swept."""

    def __init__(self, root: str):
        self.root = root
        self.owner: str | None = None

    def set_owner(self, owner: str) -> None:
        if not isinstance(owner, str) or not _SAFE.match(owner) or owner in (".", ".."):
            raise ValueError(f"owner: must be a name of [A-Za-z0-9_.-], got {owner!r}")
        self.owner = owner

    def _dir(self) -> str:
        return os.path.join(self.root, MARKS_DIR, self.owner)

    def mark(self, env_id: str) -> None:
        """Record ``env_id``'s directory as this owner's (made, or adopted after a restart: a directory
        made before marks existed is marked once the state says it is ours)."""
        if self.owner is None:
            return
        for attempt in range(3):  # another service sharing the root may remove an empty marks dir meanwhile
            os.makedirs(self._dir(), exist_ok=True)
            try:
                with open(os.path.join(self._dir(), env_id), "a"):
                    return
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def unmark(self, env_id: str) -> None:
        if self.owner is None:
            return
        try:
            os.unlink(os.path.join(self._dir(), env_id))
        except FileNotFoundError:
            pass
        for d in (self._dir(), os.path.join(self.root, MARKS_DIR)):  # the last mark goes: leave no trace
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): others' marks stay
                break

    def marked(self) -> list[str]:
        """The environments this owner has marked (their directories may be gone)."""
        if self.owner is None:
            return []
        try:
            return sorted(os.listdir(self._dir()))
        except FileNotFoundError:
            return []
