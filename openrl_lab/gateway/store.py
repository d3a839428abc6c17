"""The control plane's durable state in SQLite (WAL): sessions, training runs, samplers, checkpoints and
futures, beside the users' keys and kernels' join tokens (openrl_lab/identity.py). Every row has an owner;
lookups take the owner so one user's key never finds another user's objects.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrl_lab.identity import KeyStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL, last_heartbeat REAL NOT NULL,
  tags TEXT NOT NULL DEFAULT '[]', user_metadata TEXT NOT NULL DEFAULT '{}', display_name TEXT,
  project_id TEXT, finished TEXT);
CREATE TABLE IF NOT EXISTS models (
  model_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
  lora TEXT, created_at REAL NOT NULL, last_request_time REAL NOT NULL, user_metadata TEXT,
  epoch TEXT NOT NULL, job_id TEXT, freed TEXT);
CREATE TABLE IF NOT EXISTS samplers (
  sampler_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
  model_path TEXT, source_model_id TEXT, created_at REAL NOT NULL, epoch TEXT NOT NULL, freed TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (
  tinker_path TEXT PRIMARY KEY, owner TEXT NOT NULL, training_run_id TEXT NOT NULL,
  checkpoint_id TEXT NOT NULL, checkpoint_type TEXT NOT NULL, fs_path TEXT NOT NULL,
  size_bytes INTEGER, created_at REAL NOT NULL, expires_at REAL, public INTEGER NOT NULL DEFAULT 0,
  user_metadata TEXT);
CREATE TABLE IF NOT EXISTS futures (
  request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, target TEXT, seq_id INTEGER,
  status TEXT NOT NULL, content_type TEXT, result BLOB, created_at REAL NOT NULL, finished_at REAL);
-- The notebook layer's named leases (a name -> the model handle and kernel job it trains) and the metric
-- history a notebook logs for them, so a fresh notebook kernel can reattach and replay its plots.
CREATE TABLE IF NOT EXISTS lab_leases (
  owner TEXT NOT NULL, name TEXT NOT NULL, group_id TEXT NOT NULL, base_model TEXT NOT NULL, rank INTEGER,
  model_id TEXT NOT NULL, job_id TEXT NOT NULL, checkpoint TEXT, created_at REAL NOT NULL,
  updated_at REAL NOT NULL, PRIMARY KEY (owner, name));
CREATE TABLE IF NOT EXISTS lab_metrics (
  owner TEXT NOT NULL, name TEXT NOT NULL, step INTEGER NOT NULL, time REAL NOT NULL, metrics TEXT NOT NULL,
  PRIMARY KEY (owner, name, step));
CREATE UNIQUE INDEX IF NOT EXISTS futures_dedup ON futures(target, seq_id) WHERE seq_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS checkpoints_run ON checkpoints(training_run_id);
CREATE INDEX IF NOT EXISTS futures_pending ON futures(target) WHERE status='pending';
CREATE INDEX IF NOT EXISTS models_session ON models(session_id);
CREATE INDEX IF NOT EXISTS sessions_open ON sessions(last_heartbeat) WHERE finished IS NULL;
CREATE INDEX IF NOT EXISTS samplers_session ON samplers(session_id);
"""


# Columns added since the first schema (TEXT, NULL by default): job_id for reattached handles, freed (why a
# model's or sampler's run left the kernel) for sessions that end.
# lab_leases.variant: a fork's settings and where it came from (JSON: {"forked_from", "step", "settings"})
# models.ranks: a run on several devices, every rank's kernel epoch (JSON list, rank 0 first; gateway/gang.py)
ADDED_COLUMNS = (
    ("models", "job_id"),
    ("models", "freed"),
    ("samplers", "freed"),
    ("lab_leases", "variant"),
    ("models", "ranks"),
)


@dataclass
class FutureRow:
    request_id: str
    owner: str
    kind: str
    status: str  # pending | done | error
    content_type: str | None
    result: bytes | None
    target: str | None = None  # the model or sampler it is for


class Store(KeyStore):
    """Sessions, runs, samplers, checkpoints, futures and the notebook layer's leases, beside the keys and tokens
    of `KeyStore` (openrl_lab/identity.py) in the same database."""

    def __init__(self, path: Path):
        super().__init__(path, SCHEMA)
        self._touched: dict[str, float] = {}
        with self._lock:
            for table, column in ADDED_COLUMNS:  # a database from before the column existed
                if column not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")

    # --- sessions ---------------------------------------------------------------------------------
    def create_session(
        self,
        session_id: str,
        owner: str,
        tags: list,
        user_metadata: dict,
        display_name: str | None,
        project_id: str | None,
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,NULL)",
            (session_id, owner, now, now, json.dumps(tags), json.dumps(user_metadata), display_name, project_id),
        )

    def session(self, session_id: str, owner: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM sessions WHERE session_id=? AND owner=?", (session_id, owner))

    def touch_session(self, session_id: str) -> None:
        self._exec("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))

    def finish_session(self, session_id: str, reason: str, only_if_open: bool = False) -> None:
        self._exec(
            "UPDATE sessions SET finished=? WHERE session_id=?" + (" AND finished IS NULL" if only_if_open else ""),
            (reason, session_id),
        )

    def silent_sessions(self, before: float) -> list[str]:
        """Open sessions with no heartbeat since `before` and no request to any of their models since then."""
        return [
            r["session_id"]
            for r in self._all(
                "SELECT session_id FROM sessions s WHERE finished IS NULL AND last_heartbeat < ? AND NOT EXISTS "
                "(SELECT 1 FROM models m WHERE m.session_id=s.session_id AND m.last_request_time >= ?)",
                (before, before),
            )
        ]

    def finished_sessions_holding_runs(self) -> list[tuple[str, str]]:
        """(session_id, how it finished) of finished sessions whose models or samplers were not freed."""
        return [
            (r["session_id"], r["finished"])
            for r in self._all(
                "SELECT session_id, finished FROM sessions s WHERE finished IS NOT NULL AND (EXISTS (SELECT 1 "
                "FROM models m WHERE m.session_id=s.session_id AND m.freed IS NULL) OR EXISTS (SELECT 1 "
                "FROM samplers p WHERE p.session_id=s.session_id AND p.freed IS NULL))"
            )
        ]

    def live_session_models(self, session_id: str) -> list[sqlite3.Row]:
        return self._all("SELECT * FROM models WHERE session_id=? AND freed IS NULL", (session_id,))

    def live_gangs_on(self, epoch: str) -> list[sqlite3.Row]:
        """The runs on several devices not freed yet that have a rank on kernel `epoch`."""
        return self._all(
            "SELECT * FROM models WHERE freed IS NULL AND ranks IS NOT NULL AND ranks LIKE ?", (f'%"{epoch}"%',)
        )

    def live_session_samplers(self, session_id: str) -> list[sqlite3.Row]:
        return self._all("SELECT * FROM samplers WHERE session_id=? AND freed IS NULL", (session_id,))

    def job_held_elsewhere(self, job_id: str, session_id: str) -> bool:
        """Whether a kernel job is driven by a live handle of another session, or held by a lab lease."""
        return (
            self._one(
                "SELECT 1 FROM models WHERE COALESCE(job_id, model_id)=? AND session_id<>? AND freed IS NULL "
                "UNION SELECT 1 FROM lab_leases WHERE job_id=?",
                (job_id, session_id, job_id),
            )
            is not None
        )

    def mark_freed(self, session_id: str, why: str) -> None:
        with self._transaction() as db:
            for table in ("models", "samplers"):
                db.execute(f"UPDATE {table} SET freed=? WHERE session_id=? AND freed IS NULL", (why, session_id))

    def set_session_project(self, session_id: str, project_id: str | None) -> None:
        self._exec("UPDATE sessions SET project_id=? WHERE session_id=?", (project_id, session_id))

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[str]:
        rows = self._all(
            "SELECT session_id FROM sessions WHERE owner=? ORDER BY created_at DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        return [r["session_id"] for r in rows]

    # --- training runs (models) -------------------------------------------------------------------
    def add_model(
        self,
        model_id: str,
        owner: str,
        session_id: str,
        base_model: str,
        lora: dict | None,
        user_metadata: dict | None,
        epoch: str,
        job_id: str | None = None,
        ranks: list[str] | None = None,
    ) -> None:
        """`job_id`: the kernel job this handle drives, when it is not the model's own (a reattached handle).
        `ranks`: a run on several devices, every rank's epoch (rank 0's is `epoch`)."""
        now = time.time()
        self._exec(
            "INSERT OR REPLACE INTO models (model_id, owner, session_id, base_model, lora, created_at, "
            "last_request_time, user_metadata, epoch, job_id, ranks) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                model_id,
                owner,
                session_id,
                base_model,
                json.dumps(lora) if lora else None,
                now,
                now,
                json.dumps(user_metadata) if user_metadata else None,
                epoch,
                job_id,
                json.dumps(ranks) if ranks and len(ranks) > 1 else None,
            ),
        )

    def model(self, model_id: str, owner: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM models WHERE model_id=? AND owner=?", (model_id, owner))

    def touch_model(self, model_id: str, every_s: float = 10.0) -> None:
        """Records a request to the model; at most one write per `every_s` (this is on the hot path)."""
        now = time.time()
        if now - self._touched.get(model_id, 0.0) >= every_s:
            self._touched[model_id] = now
            self._exec("UPDATE models SET last_request_time=? WHERE model_id=?", (now, model_id))

    def list_models(self, owner: str, limit: int, offset: int) -> tuple[list, int]:
        return self._page("models", {"owner": owner}, limit, offset)

    def _page(
        self, table: str, match: dict[str, Any], limit: int, offset: int, one_of: tuple[str, tuple] | None = None
    ) -> tuple[list, int]:
        """Rows of `table` equal to `match` on every given column (and with `one_of`'s column holding one of its
        values), newest first, and their total count."""
        where = " AND ".join(f"{col}=?" for col in match)
        args = tuple(match.values())
        if one_of is not None:
            col, values = one_of
            where += f" AND {col} IN ({', '.join('?' * len(values))})"
            args += tuple(values)
        count = self._one(f"SELECT COUNT(*) AS n FROM {table} WHERE {where}", args)
        assert count is not None  # COUNT(*) always gives a row
        total = count["n"]
        rows = self._all(
            f"SELECT * FROM {table} WHERE {where} ORDER BY created_at DESC LIMIT ? OFFSET ?", (*args, limit, offset)
        )
        return rows, total

    # --- the notebook layer's named leases and metric history ------------------------------------------
    def put_lab_lease(
        self,
        owner: str,
        name: str,
        group_id: str,
        base_model: str,
        rank: int | None,
        model_id: str,
        job_id: str,
        checkpoint: str | None = None,
        variant: str | None = None,
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO lab_leases (owner, name, group_id, base_model, rank, model_id, job_id, checkpoint, "
            "created_at, updated_at, variant) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (owner, name) DO UPDATE SET "
            "group_id=excluded.group_id, base_model=excluded.base_model, rank=excluded.rank, "
            "model_id=excluded.model_id, job_id=excluded.job_id, "
            "checkpoint=COALESCE(excluded.checkpoint, lab_leases.checkpoint), updated_at=excluded.updated_at, "
            "variant=COALESCE(excluded.variant, lab_leases.variant)",
            (owner, name, group_id, base_model, rank, model_id, job_id, checkpoint, now, now, variant),
        )

    def update_lab_lease(self, owner: str, name: str, **fields: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in fields)
        self._exec(
            f"UPDATE lab_leases SET {sets}, updated_at=? WHERE owner=? AND name=?",
            (*fields.values(), time.time(), owner, name),
        )

    def lab_lease(self, owner: str, name: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM lab_leases WHERE owner=? AND name=?", (owner, name))

    def lab_leases(self, owner: str, name: str | None = None) -> list[sqlite3.Row]:
        """The owner's leases (or the one named), each with the last step it logged."""
        return self._all(
            "SELECT l.*, (SELECT MAX(step) FROM lab_metrics m WHERE m.owner=l.owner AND m.name=l.name) AS last_step "
            "FROM lab_leases l WHERE owner=? AND (? IS NULL OR name=?) ORDER BY created_at",
            (owner, name, name),
        )

    def delete_lab_lease(self, owner: str, name: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM lab_leases WHERE owner=? AND name=?", (owner, name))
            db.execute("DELETE FROM lab_metrics WHERE owner=? AND name=?", (owner, name))

    def add_lab_metrics(self, owner: str, name: str, rows: list[tuple[int, float, str]]) -> None:
        """(step, time, metrics JSON) rows; a step logged again replaces the earlier row (a resumed loop)."""
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO lab_metrics VALUES (?,?,?,?,?)", [(owner, name, *r) for r in rows])

    def lab_metrics(self, owner: str, name: str, after_step: int, limit: int) -> list[sqlite3.Row]:
        return self._all(
            "SELECT step, time, metrics FROM lab_metrics WHERE owner=? AND name=? AND step>? ORDER BY step LIMIT ?",
            (owner, name, after_step, limit),
        )

    # --- samplers ---------------------------------------------------------------------------------
    def add_sampler(
        self,
        sampler_id: str,
        owner: str,
        session_id: str,
        base_model: str,
        model_path: str | None,
        source_model_id: str | None,
        epoch: str,
    ) -> None:
        self._exec(
            "INSERT OR REPLACE INTO samplers (sampler_id, owner, session_id, base_model, model_path, "
            "source_model_id, created_at, epoch) VALUES (?,?,?,?,?,?,?,?)",
            (sampler_id, owner, session_id, base_model, model_path, source_model_id, time.time(), epoch),
        )

    def sampler(self, sampler_id: str, owner: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM samplers WHERE sampler_id=? AND owner=?", (sampler_id, owner))

    def session_samplers(self, session_id: str) -> list[str]:
        return [
            r["sampler_id"]
            for r in self._all("SELECT sampler_id FROM samplers WHERE session_id=? ORDER BY created_at", (session_id,))
        ]

    def session_models(self, session_id: str) -> list[str]:
        return [
            r["model_id"]
            for r in self._all("SELECT model_id FROM models WHERE session_id=? ORDER BY created_at", (session_id,))
        ]

    # --- checkpoints ------------------------------------------------------------------------------
    def add_checkpoint(
        self,
        tinker_path: str,
        owner: str,
        training_run_id: str,
        checkpoint_id: str,
        checkpoint_type: str,
        fs_path: str,
        size_bytes: int,
        ttl_seconds: int | None,
        user_metadata: dict | None,
    ) -> None:
        now = time.time()
        expires = now + ttl_seconds if ttl_seconds else None
        with self._lock:  # an acknowledged checkpoint must survive even a power cut: sync this commit fully
            self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?,0,?)",
                    (
                        tinker_path,
                        owner,
                        training_run_id,
                        checkpoint_id,
                        checkpoint_type,
                        fs_path,
                        size_bytes,
                        now,
                        expires,
                        json.dumps(user_metadata) if user_metadata else None,
                    ),
                )
            finally:
                self._db.execute("PRAGMA synchronous=NORMAL")

    def checkpoint(self, tinker_path: str, owner: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM checkpoints WHERE tinker_path=? AND owner=?", (tinker_path, owner))

    def public_checkpoint(self, tinker_path: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM checkpoints WHERE tinker_path=? AND public=1", (tinker_path,))

    def list_checkpoints(
        self,
        owner: str,
        training_run_id: str | None,
        limit: int = 1000,
        offset: int = 0,
        kinds: tuple[str, ...] | None = None,
    ) -> tuple[list, int]:
        """`kinds`: only checkpoints of these types (None: all)."""
        match = {"owner": owner} | ({"training_run_id": training_run_id} if training_run_id else {})
        return self._page("checkpoints", match, limit, offset, ("checkpoint_type", kinds) if kinds else None)

    def last_checkpoint(self, owner: str, training_run_id: str, kind: str) -> sqlite3.Row | None:
        """The run's newest checkpoint of `kind` (training or sampler)."""
        return self._one(
            "SELECT * FROM checkpoints WHERE owner=? AND training_run_id=? AND checkpoint_type=? "
            "ORDER BY created_at DESC LIMIT 1",
            (owner, training_run_id, kind),
        )

    def delete_checkpoint(self, tinker_path: str) -> None:
        self._exec("DELETE FROM checkpoints WHERE tinker_path=?", (tinker_path,))

    def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        expires = time.time() + ttl_seconds if ttl_seconds else None
        self._exec("UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (expires, tinker_path))

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        self._exec("UPDATE checkpoints SET public=? WHERE tinker_path=?", (int(public), tinker_path))

    def expired_checkpoints(self) -> list[sqlite3.Row]:
        return self._all("SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at < ?", (time.time(),))

    # --- futures ----------------------------------------------------------------------------------
    def add_future(self, request_id: str, owner: str, kind: str, target: str | None, seq_id: int | None) -> str:
        """Records a pending future; returns the id of an earlier one with the same (target, seq_id)."""
        try:
            self._exec(
                "INSERT INTO futures VALUES (?,?,?,?,?,'pending',NULL,NULL,?,NULL)",
                (request_id, owner, kind, target, seq_id, time.time()),
            )
            return request_id
        except sqlite3.IntegrityError:
            row = self._one("SELECT request_id FROM futures WHERE target=? AND seq_id=?", (target, seq_id))
            if row is None:  # not the (target, seq_id) dedup: the request_id itself was taken
                raise
            return row["request_id"]

    def finish_future(self, request_id: str, status: str, content_type: str, result: bytes) -> None:
        self._exec(
            "UPDATE futures SET status=?, content_type=?, result=?, finished_at=? WHERE request_id=?",
            (status, content_type, result, time.time(), request_id),
        )

    def future(self, request_id: str, owner: str) -> FutureRow | None:
        row = self._one(
            "SELECT request_id, owner, kind, status, content_type, result, target FROM futures "
            "WHERE request_id=? AND owner=?",
            (request_id, owner),
        )
        return FutureRow(**dict(row)) if row else None

    def pending_futures(self, target: str) -> list[str]:
        return [
            r["request_id"]
            for r in self._all("SELECT request_id FROM futures WHERE target=? AND status='pending'", (target,))
        ]

    def fail_pending_futures(self, message: str) -> int:
        body = json.dumps({"error": message, "category": "server"}).encode()
        cur = self._exec(
            "UPDATE futures SET status='error', content_type='application/json', result=?, "
            "finished_at=? WHERE status='pending'",
            (body, time.time()),
        )
        return cur.rowcount

    def prune_futures(self, older_than_s: float) -> None:
        self._exec(
            "DELETE FROM futures WHERE finished_at IS NOT NULL AND finished_at < ?", (time.time() - older_than_s,)
        )


def job_of(row) -> str:
    """The kernel job a model handle drives: its own id, or the job it reattached to (the notebook layer)."""
    return row["job_id"] or row["model_id"]


def loads(value: str | None) -> Any:
    return json.loads(value) if value else None


def loads_metadata(value: str | None) -> dict[str, str] | None:
    """user_metadata as the SDK reads it back: string values. Rows stored before the gateway refused other
    values (numbers, NaN) show those as their JSON text."""
    metadata = loads(value)
    if not isinstance(metadata, dict):
        return metadata
    return {key: item if isinstance(item, str) else json.dumps(item) for key, item in metadata.items()}
