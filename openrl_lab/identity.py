"""Who may do what: users' API keys and kernels' join tokens, stored hashed in the control plane's SQLite database
(`state.db`, WAL). Its own room, below everything that checks a key (the gateway's HTTP API, the orchestrator's
and the fleet's gRPC services, the CLI's `keys` and `tokens`); it imports nothing of the project.

`KeyStore` is also the base of the gateway's `Store` (same file, one connection): `Database` is the connection
with its lock and the helpers both use.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
  key_hash TEXT PRIMARY KEY, user TEXT NOT NULL, name TEXT NOT NULL, created_at REAL NOT NULL);
-- Join tokens of kernels on other hosts (`openrl-lab tokens create --kernel`): only their hashes.
CREATE TABLE IF NOT EXISTS join_tokens (
  token_hash TEXT PRIMARY KEY, label TEXT NOT NULL, created_at REAL NOT NULL);
"""

KERNEL_USER = "openrl-kernel"  # the identity kernels act under (gRPC only: the gateway refuses it over HTTP)
USER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# What a key or join token given from outside must look like (`serve --api-keys-dir`, `--join-token-file`): the
# shapes `new_api_key` / `new_join_token` make, with room for other generators of at least 32 URL-safe characters.
GIVEN_API_KEY = re.compile(r"tml-[A-Za-z0-9_-]{32,}")
GIVEN_JOIN_TOKEN = re.compile(r"orl-join-[A-Za-z0-9_-]{32,}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_join_token() -> str:
    # Its own prefix: a join token is never mistaken for (or accepted as) a user's API key.
    return "orl-join-" + secrets.token_urlsafe(32)


def new_api_key() -> str:
    # The tinker SDK refuses keys without the tml- prefix.
    return "tml-" + secrets.token_urlsafe(32)


class Database:
    """One SQLite connection (WAL), thread-safe: guarded by a lock (SQLite serialises writers anyway)."""

    def __init__(self, path: Path, schema: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL survives a process crash; checkpoint records also force a full sync (gateway/store.py).
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(schema)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()


class KeyStore(Database):
    """Users' API keys and kernels' join tokens (`schema`: more tables in the same database, the gateway's)."""

    def __init__(self, path: Path, schema: str = ""):
        super().__init__(path, SCHEMA + schema)

    # --- keys -------------------------------------------------------------------------------------
    def add_key(self, user: str, name: str, key: str | None = None) -> str:
        # User names become directory names (checkpoints/<user>/...): keep them plain.
        if not USER_NAME.fullmatch(user) or user in (".", ".."):
            raise ValueError(f"user name {user!r} is not allowed: use letters, digits, '.', '_' or '-' (max 64)")
        key = key or new_api_key()
        self._exec("INSERT INTO api_keys VALUES (?,?,?,?)", (hash_key(key), user, name, time.time()))
        return key

    def set_keys(self, name: str, keys: dict[str, str]) -> None:
        """Makes `keys` (user -> key) exactly the keys labelled `name` (`serve --api-keys-dir`: keys kept in a
        Kubernetes Secret): new ones are added, and those an earlier call gave that are not in `keys` are revoked.
        Keys made otherwise (`keys create`) are left alone."""
        for user, key in keys.items():
            if not USER_NAME.fullmatch(user) or user in (".", ".."):
                raise ValueError(f"user name {user!r} is not allowed: use letters, digits, '.', '_' or '-' (max 64)")
            if not GIVEN_API_KEY.fullmatch(key):
                raise ValueError(
                    f"the key of user {user!r} is not one: 'tml-' and at least 32 letters, digits, "
                    "'_' or '-' (the tinker SDK refuses keys without the prefix)"
                )
        wanted = {hash_key(key): user for user, key in keys.items()}
        with self._transaction() as db:
            had = {r[0] for r in db.execute("SELECT key_hash FROM api_keys WHERE name=?", (name,))}
            db.executemany("DELETE FROM api_keys WHERE key_hash=?", [(h,) for h in had - wanted.keys()])
            db.executemany(
                "INSERT INTO api_keys VALUES (?,?,?,?) ON CONFLICT(key_hash) DO UPDATE SET "
                "user=excluded.user, name=excluded.name",
                [(h, user, name, time.time()) for h, user in wanted.items()],
            )

    def user_for_key(self, key: str) -> str | None:
        row = self._one("SELECT user FROM api_keys WHERE key_hash=?", (hash_key(key),))
        return row["user"] if row else None

    def list_keys(self) -> list[dict]:
        """user, label, created_at and key_id (a prefix of the key's hash: names a key without revealing it)."""
        rows = self._all(
            "SELECT user, name, created_at, substr(key_hash, 1, 12) AS key_id FROM api_keys ORDER BY created_at"
        )
        return [dict(r) for r in rows]

    def revoke_keys(self, user: str, name: str | None = None, key_id: str | None = None) -> int:
        """Deletes `user`'s keys (only those labelled `name`, or whose key_id starts with `key_id`); how many.
        Takes effect at once: every request and RPC looks its key up again."""
        sql, args = "DELETE FROM api_keys WHERE user=?", [user]
        if name is not None:
            sql, args = sql + " AND name=?", [*args, name]
        if key_id is not None:
            sql, args = sql + " AND substr(key_hash, 1, ?)=?", [*args, len(key_id), key_id.lower()]
        return self._exec(sql, tuple(args)).rowcount

    # --- kernels' join tokens ---------------------------------------------------------------------
    def add_join_token(self, label: str) -> str:
        token = new_join_token()
        self._exec("INSERT INTO join_tokens VALUES (?,?,?)", (hash_key(token), label, time.time()))
        return token

    def set_join_token(self, label: str, token: str) -> None:
        """Makes `token` the one join token labelled `label` (`serve --join-token-file`: a token kept in a
        Kubernetes Secret): registered if new, any other token under that label revoked (so a replaced Secret
        and a restart rotate it, and kernels that joined with the old one leave the fleet)."""
        if not GIVEN_JOIN_TOKEN.fullmatch(token):
            raise ValueError(
                "a join token is 'orl-join-' and at least 32 letters, digits, '_' or '-' "
                "(`openrl-lab tokens create --kernel` makes one)"
            )
        h = hash_key(token)
        with self._transaction() as db:
            db.execute("DELETE FROM join_tokens WHERE label=? AND token_hash<>?", (label, h))
            db.execute("INSERT OR IGNORE INTO join_tokens VALUES (?,?,?)", (h, label, time.time()))

    def join_token_label(self, token_hash: str) -> str | None:
        """The label of the valid join token with this hash (`hash_key`), else None (revoked, never made, or an
        API key's)."""
        row = self._one("SELECT label FROM join_tokens WHERE token_hash=?", (token_hash,))
        return row["label"] if row else None

    def list_join_tokens(self) -> list[dict]:
        rows = self._all(
            "SELECT label, created_at, substr(token_hash, 1, 12) AS token_id FROM join_tokens ORDER BY created_at"
        )
        return [dict(r) for r in rows]

    def revoke_join_tokens(self, token_id: str) -> int:
        """Deletes the join tokens whose id starts with `token_id`; kernels that joined with them are dropped from
        the fleet within a heartbeat (`cluster/fleet.py`)."""
        return self._exec(
            "DELETE FROM join_tokens WHERE substr(token_hash, 1, ?)=?", (len(token_id), token_id.lower())
        ).rowcount
