"""The service's durable state: environments, their placement and actions, in SQLite.

What is written, and when (so a crash loses nothing a caller was told):

* an environment, before ``POST /v1/environments`` answers 201, and its node:
  then too on a service of one node, else once it is made on the node of its
  first action, before that action runs;
* an action (id, idempotency key, environment), before it is submitted and acknowledged;
* its outcome, when it finishes (the listener of the runtime).

On start, with the same state directory, the service reconciles
(:mod:`tangram.service.recover`): recorded environments whose directory or
container still exists are reattached, everything else the service owns is
removed, and actions that were in flight are answered ``failed`` with
``retryable: true``. Finished outcomes are kept up to ``keep_results``; past
that an action's row keeps only its id and status ``expired`` (the service
answers 410 Gone; 404 stays for ids never seen), and past ten times that the
oldest ids are forgotten too.

One service per state directory: an exclusive ``flock`` on ``<dir>/lock``.
The schema carries a version and migrates forward on open; a database newer
than this code is refused. Without a directory the same store lives in memory
(tests, in-process use): same behaviour, nothing survives the process.
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
import uuid
from typing import Any, Iterator

SCHEMA_VERSION = 2
# forward migrations: MIGRATIONS[v] takes a database at version v to v + 1
MIGRATIONS: list[str] = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE environments (
        id TEXT PRIMARY KEY, image TEXT, memory_mb INTEGER NOT NULL, labels TEXT NOT NULL,
        node TEXT, created_at REAL NOT NULL, last_used REAL NOT NULL);
    CREATE TABLE actions (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, idem_key TEXT UNIQUE,
        environment TEXT, status TEXT NOT NULL, outcome TEXT, submitted_at REAL NOT NULL, finished_at REAL);
    CREATE INDEX actions_unfinished ON actions (status) WHERE outcome IS NULL;
    """,
    # 1 -> 2: environments remember whether they asked for a network
    """
    ALTER TABLE environments ADD COLUMN network INTEGER NOT NULL DEFAULT 0;
    """,
]
FINAL = ("succeeded", "failed", "timeout", "cancelled")
EXPIRED = "expired"


class StateError(RuntimeError):
    pass


class StateStore:
    def __init__(self, directory: str | None, *, keep_results: int = 100_000):
        self.directory = directory
        self.keep_results = int(keep_results)
        self._lock_fd: int | None = None
        if directory is None:
            path = ":memory:"
        else:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lock_fd)
                self._lock_fd = None
                raise StateError(f"state directory {directory} is in use by another tangram service") from None
            path = os.path.join(directory, "state.sqlite3")
        self.db = None
        try:
            self.db = sqlite3.connect(path, isolation_level=None)  # autocommit; explicit transactions below
            if directory is not None:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")  # a committed row survives a power cut
            self._migrate()
            self.service_id = self._meta("service_id") or self._set_meta("service_id", uuid.uuid4().hex[:12])
        except BaseException as exc:
            self.close()  # the lock too: nothing of this store stays held
            if isinstance(exc, sqlite3.OperationalError):  # locked, read-only, a full disk: not the file's content
                raise StateError(f"state database {path} cannot be used: {exc}") from None
            if isinstance(exc, (sqlite3.DatabaseError, ValueError)):  # a damaged file, or rows not ours
                raise StateError(f"state database {path} cannot be read ({exc}): move it away to start "
                                 "with an empty state, or point service.state_dir elsewhere") from None
            raise
        self._finished_since_trim = 0

    # ------------------------------------------------------------------ #
    # schema

    def _version(self) -> int:
        has_meta = self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
        if not has_meta:
            return 0
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> None:
        v = self._version()
        if v > SCHEMA_VERSION:
            raise StateError(f"state database schema {v} is newer than this tangram ({SCHEMA_VERSION})")
        while v < SCHEMA_VERSION:
            with self._tx():
                for stmt in _statements(MIGRATIONS[v]):
                    self.db.execute(stmt)
                v += 1
                self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(v),))

    def _tx(self):
        db = self.db

        class _T:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, et, *_):
                db.execute("ROLLBACK" if et else "COMMIT")
                return False

        return _T()

    def _meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def _set_meta(self, key: str, value: str) -> str:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        return value

    @property
    def schema_version(self) -> int:
        return self._version()

    # ------------------------------------------------------------------ #
    # environments

    def record_environment(self, env_id: str, *, image: str | None, memory_mb: int, labels: dict, node: str | None,
                           network: bool = False) -> None:
        now = time.time()
        self.db.execute("INSERT OR REPLACE INTO environments (id, image, memory_mb, labels, node, created_at, "
                        "last_used, network) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (env_id, image, memory_mb, json.dumps(labels), node, now, now, int(network)))

    def set_environment_node(self, env_id: str, node: str) -> None:
        """The node it was made on (several nodes: at its first action, before that action runs)."""
        self.db.execute("UPDATE environments SET node=? WHERE id=? AND node IS NULL", (node, env_id))

    def touch_environment(self, env_id: str) -> None:
        self.db.execute("UPDATE environments SET last_used=? WHERE id=?", (time.time(), env_id))

    def drop_environment(self, env_id: str) -> None:
        self.db.execute("DELETE FROM environments WHERE id=?", (env_id,))

    def environments(self) -> Iterator[dict[str, Any]]:
        rows = self.db.execute("SELECT id, image, memory_mb, labels, node, created_at, last_used, network "
                               "FROM environments").fetchall()
        for row in rows:
            yield {"id": row[0], "image": row[1], "memory_mb": row[2], "labels": json.loads(row[3]),
                   "node": row[4], "created_at": row[5], "last_used": row[6], "network": bool(row[7])}

    def last_used(self, env_id: str) -> float | None:
        row = self.db.execute("SELECT last_used FROM environments WHERE id=?", (env_id,)).fetchone()
        return row[0] if row else None

    # ------------------------------------------------------------------ #
    # actions

    def record_action(self, action_id: str, *, idem_key: str | None, environment: str | None) -> None:
        self.db.execute("INSERT INTO actions (id, idem_key, environment, status, submitted_at) VALUES (?, ?, ?, ?, ?)",
                        (action_id, idem_key, environment, "waiting", time.time()))

    def forget_action(self, action_id: str) -> None:
        """An action refused before it was acknowledged: as if never sent (its key is free again)."""
        self.db.execute("DELETE FROM actions WHERE id=? AND outcome IS NULL", (action_id,))

    def action_for_key(self, idem_key: str) -> str | None:
        row = self.db.execute("SELECT id FROM actions WHERE idem_key=?", (idem_key,)).fetchone()
        return row[0] if row else None

    def finish_action(self, action_id: str, outcome: dict[str, Any]) -> None:
        self.db.execute("UPDATE actions SET status=?, outcome=?, finished_at=? WHERE id=?",
                        (outcome["status"], json.dumps(outcome), time.time(), action_id))
        self._finished_since_trim += 1
        if self._finished_since_trim >= max(1, self.keep_results // 10):
            self.trim()

    def action(self, action_id: str) -> tuple[str, dict[str, Any] | None] | None:
        """(status, outcome or None) of a recorded action, None if never seen (or long forgotten)."""
        row = self.db.execute("SELECT status, outcome FROM actions WHERE id=?", (action_id,)).fetchone()
        if row is None:
            return None
        return row[0], (json.loads(row[1]) if row[1] else None)

    def fail_in_flight(self, reason: str) -> list[str]:
        """Every action without an outcome (the service died under it): failed, retryable."""
        ids = [r[0] for r in self.db.execute("SELECT id FROM actions WHERE outcome IS NULL AND status != ?",
                                              (EXPIRED,))]
        with self._tx():
            for aid in ids:
                out = {"id": aid, "status": "failed", "error": reason, "retryable": True, "allocation": {}}
                self.db.execute("UPDATE actions SET status='failed', outcome=?, finished_at=? WHERE id=?",
                                (json.dumps(out), time.time(), aid))
        return ids

    def trim(self) -> None:
        """Keep ``keep_results`` outcomes; older ones become ``expired`` ids; ids past 10x that are dropped."""
        self._finished_since_trim = 0
        with self._tx():
            self.db.execute(
                "UPDATE actions SET status=?, outcome=NULL WHERE outcome IS NOT NULL AND seq <= "
                "(SELECT seq FROM actions WHERE outcome IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (EXPIRED, self.keep_results))
            self.db.execute(
                "DELETE FROM actions WHERE status=? AND seq <= "
                "(SELECT seq FROM actions ORDER BY seq DESC LIMIT 1 OFFSET ?)", (EXPIRED, 10 * self.keep_results))

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
