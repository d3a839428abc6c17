"""The orchestrator's SQLite state: leases, each group's resident job, and the timeline of slices.

Lease creation, changes and removal are written at once (a lease survives a crash of the control plane
the moment `create_lease` returns). Counters that change on every slice (usage, fair-share tags) and the
timeline are written behind, coalesced, by one thread every `flush_s` (and on close): a crash loses at
most that much of them, never a lease.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS orch_leases (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, group_id TEXT NOT NULL, name TEXT NOT NULL,
  weight REAL NOT NULL, quota_s REAL NOT NULL, ttl_s REAL NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
  used_s REAL NOT NULL, slices INTEGER NOT NULL, last_served_at REAL NOT NULL, finish_tag REAL NOT NULL,
  state_loc TEXT NOT NULL, evictions INTEGER NOT NULL, restores INTEGER NOT NULL,
  agent TEXT NOT NULL DEFAULT '', res_instance TEXT NOT NULL DEFAULT '', res_incarnation TEXT NOT NULL DEFAULT '',
  agent_instance TEXT NOT NULL DEFAULT '', agent_incarnation TEXT NOT NULL DEFAULT '',
  priority TEXT NOT NULL DEFAULT 'batch',
  UNIQUE (owner, group_id, name));
CREATE TABLE IF NOT EXISTS orch_groups (id TEXT PRIMARY KEY, resident TEXT, vclock REAL NOT NULL);
CREATE TABLE IF NOT EXISTS orch_slices (
  slice_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, group_id TEXT NOT NULL, lease_id TEXT NOT NULL, job TEXT NOT NULL,
  owner TEXT NOT NULL, kind TEXT NOT NULL, requested_at REAL NOT NULL, granted_at REAL NOT NULL,
  released_at REAL NOT NULL, wait_s REAL NOT NULL, run_s REAL NOT NULL, switch_s REAL NOT NULL,
  restore_s REAL NOT NULL, evict_s REAL NOT NULL, must_restore INTEGER NOT NULL, outcome TEXT NOT NULL,
  error TEXT NOT NULL, priority TEXT NOT NULL DEFAULT 'batch', gang TEXT NOT NULL DEFAULT '',
  gang_size INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS orch_slices_group_seq ON orch_slices (group_id, seq);
"""

LEASE_COLUMNS = (
    "id",
    "owner",
    "group_id",
    "name",
    "weight",
    "quota_s",
    "ttl_s",
    "created_at",
    "expires_at",
    "used_s",
    "slices",
    "last_served_at",
    "finish_tag",
    "state_loc",
    "evictions",
    "restores",
    "agent",
    "res_instance",
    "res_incarnation",
    "agent_instance",
    "agent_incarnation",
    "priority",
)
# Columns added since the first schema: (table, name, declaration) for ALTER TABLE on an older database.
ADDED_COLUMNS = (
    *(
        ("orch_leases", name, "TEXT NOT NULL DEFAULT ''")
        for name in ("agent", "res_instance", "res_incarnation", "agent_instance", "agent_incarnation")
    ),
    ("orch_leases", "priority", "TEXT NOT NULL DEFAULT 'batch'"),
    ("orch_slices", "priority", "TEXT NOT NULL DEFAULT 'batch'"),
    ("orch_slices", "gang", "TEXT NOT NULL DEFAULT ''"),
    ("orch_slices", "gang_size", "INTEGER NOT NULL DEFAULT 0"),
)
SLICE_COLUMNS = (
    "slice_id",
    "seq",
    "group_id",
    "lease_id",
    "job",
    "owner",
    "kind",
    "requested_at",
    "granted_at",
    "released_at",
    "wait_s",
    "run_s",
    "switch_s",
    "restore_s",
    "evict_s",
    "must_restore",
    "outcome",
    "error",
    "priority",
    "gang",
    "gang_size",
)


def _upsert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


class OrchestratorStore:
    def __init__(self, path: str | Path, flush_s: float = 0.1):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        have = {
            (table, r[1])
            for table in ("orch_leases", "orch_slices")
            for r in self._db.execute(f"PRAGMA table_info({table})")
        }
        for table, name, decl in ADDED_COLUMNS:
            if (table, name) not in have:  # a database written before the column existed
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        # Two locks: `_lock` guards only the pending rows, so the scheduler (which queues rows under its own
        # lock, on every grant and release) never waits for SQLite; `_db` is used under `_db_lock`, always
        # taken before `_lock` where both are needed.
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()
        self._pending: dict[tuple[str, str], tuple] = {}  # (table, key) -> row, newest wins
        self._flush_s = flush_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._flusher, name="orchestrator-store", daemon=True)
        self._thread.start()

    # --- reading at start -------------------------------------------------------------------------
    def load(self, recent_per_group: int) -> dict[str, Any]:
        """Leases, groups and the most recent slices per group. Slices left running by a previous process
        are marked `interrupted`."""
        with self._db_lock:
            self._db.execute("UPDATE orch_slices SET outcome='interrupted' WHERE outcome='running'")
            leases = [dict(r) for r in self._db.execute("SELECT * FROM orch_leases")]
            groups = {r["id"]: dict(r) for r in self._db.execute("SELECT * FROM orch_groups")}
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM orch_slices").fetchone()[0]
            slices: dict[str, list[dict]] = {}
            for gid in {r[0] for r in self._db.execute("SELECT DISTINCT group_id FROM orch_slices")}:
                rows = self._db.execute(
                    "SELECT * FROM orch_slices WHERE group_id=? ORDER BY seq DESC LIMIT ?", (gid, recent_per_group)
                ).fetchall()
                slices[gid] = [dict(r) for r in reversed(rows)]
        return {"leases": leases, "groups": groups, "slices": slices, "seq": seq}

    def slices_between(self, group_id: str, after_seq: int, before_seq: int, since: float, limit: int) -> list[dict]:
        """The first `limit` slices of a group with after_seq < seq < before_seq that were running or released
        at or after `since`, in seq order."""
        with self._db_lock:
            rows = self._db.execute(
                "SELECT * FROM orch_slices WHERE group_id=? AND seq>? AND seq<? AND (released_at>=? OR released_at=0) "
                "ORDER BY seq LIMIT ?",
                (group_id, after_seq, before_seq, since, limit),
            ).fetchall()
        return [dict(r) for r in rows]

    # --- writing ----------------------------------------------------------------------------------
    def put_lease(self, row: tuple) -> None:
        """Now (a lease must not be lost once acknowledged)."""
        with self._db_lock:
            with self._lock:
                self._pending.pop(("lease", row[0]), None)
            self._db.execute(_upsert("orch_leases", LEASE_COLUMNS), row)

    def delete_lease(self, lease_id: str) -> None:
        with self._db_lock:
            with self._lock:
                self._pending.pop(("lease", lease_id), None)
            self._db.execute("DELETE FROM orch_leases WHERE id=?", (lease_id,))

    def lease_later(self, row: tuple) -> None:
        with self._lock:
            self._pending[("lease", row[0])] = row

    def group_later(self, group_id: str, resident: str | None, vclock: float) -> None:
        with self._lock:
            self._pending[("group", group_id)] = (group_id, resident, vclock)

    def slice_later(self, row: tuple) -> None:
        with self._lock:
            self._pending[("slice", row[0])] = row

    def flush(self) -> None:
        # The rows are taken under `_db_lock` too: no immediate write (put_lease) can come between taking an
        # older row and writing it, so the newest row always wins.
        with self._db_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
            if not pending:
                return
            by_table: dict[str, list[tuple]] = {"lease": [], "group": [], "slice": []}
            for (table, _), row in pending.items():
                by_table[table].append(row)
            self._db.execute("BEGIN")
            try:
                # A lease deleted since its counters were queued must stay deleted: update only rows that exist.
                for row in by_table["lease"]:
                    self._db.execute(
                        f"UPDATE orch_leases SET {', '.join(c + '=?' for c in LEASE_COLUMNS[1:])} WHERE id=?",
                        (*row[1:], row[0]),
                    )
                self._db.executemany(
                    "INSERT OR REPLACE INTO orch_groups (id, resident, vclock) VALUES (?,?,?)", by_table["group"]
                )
                self._db.executemany(_upsert("orch_slices", SLICE_COLUMNS), by_table["slice"])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                with self._lock:
                    for key, row in pending.items():  # keep them for the next flush (newer rows win)
                        self._pending.setdefault(key, row)
                raise

    def _flusher(self) -> None:
        while not self._closed.wait(self._flush_s):
            try:
                self.flush()
            except sqlite3.Error as e:  # a full disk must not kill the scheduler; the next flush retries
                import logging

                logging.getLogger(__name__).warning("orchestrator store: flush failed: %s", e)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5)
        self.flush()
        with self._db_lock:
            self._db.close()
