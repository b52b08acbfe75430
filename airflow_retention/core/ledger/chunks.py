"""Statements on the ledger's ``chunks`` table: a plan's chunks inserted and read back, and each chunk's
progress, written inside the engine's batch transaction (locked, one batch recorded, completed), with
the partition action a chunk takes and the error an attempt ends on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.ledger.schema import LedgerSchema

_CHUNK_FIELDS = (
    "run_key", "chunk_key", "seq", "tenants", "lo", "hi", "rows_planned", "state", "next_key",
    "rows_deleted", "rows_archived", "rows_matched", "batches", "attempts", "first_started_at",
    "last_batch_at", "completed_at", "completed_dag_id", "completed_run_id", "completed_map_index",
    "completed_try_number", "completed_host", "last_host", "outcome", "last_error", "tenant_pos",
    "last_batch_size", "min_batch_size", "max_batch_size", "backoffs", "backoff_seconds", "partition",
    "partition_oid", "action", "action_started_at", "paused",
)  # fmt: skip
# ``paused`` came with ledger version 8: read from the row as JSON, so that a ledger not migrated yet (status
# before the next run's first task migrates it) reads as having paused nothing.
_CHUNK_COLUMNS = ", ".join(
    "coalesce(to_jsonb(chunks) -> 'paused', '{}'::jsonb)" if f == "paused" else f for f in _CHUNK_FIELDS
)
# A batch's pauses by reason (jsonb {reason: seconds}) added to the chunk's.
_ADD_PAUSED = (
    "paused || coalesce((SELECT jsonb_object_agg(d.key, coalesce((paused ->> d.key)::float8, 0) + d.value::float8)"
    " FROM jsonb_each_text(%(paused)s::jsonb) d), '{}'::jsonb)"
)


class LedgerChunks(LedgerSchema):
    """The chunks of the ledger's runs."""

    # -- a run's plan -----------------------------------------------------------------------------

    def insert_chunks(self, cur: Any, run_key: str, chunks: Sequence[ChunkSpec]) -> None:
        for chunk in chunks:
            self.insert_chunk(cur, run_key, chunk)

    def insert_chunk(self, cur: Any, run_key: str, chunk: ChunkSpec) -> None:
        cur.execute(
            f"INSERT INTO {self.s}.chunks (run_key, chunk_key, seq, tenants, lo, hi, rows_planned, next_key,"
            " partition, partition_oid, action)"
            " VALUES (%(run_key)s, %(key)s, %(seq)s::integer, %(tenants)s::text[], %(lo)s::bigint,"
            " %(hi)s::bigint, %(rows)s::bigint, %(lo)s::bigint, %(partition)s::text, %(oid)s::bigint,"
            " %(action)s::text)"
            " ON CONFLICT (run_key, chunk_key) DO NOTHING",
            {
                "partition": chunk.partition,
                "oid": chunk.partition_oid,
                "action": chunk.action,
                "run_key": run_key,
                "key": chunk.key,
                "seq": chunk.seq,
                "tenants": list(chunk.tenants) if chunk.tenants is not None else None,
                "lo": chunk.lo,
                "hi": chunk.hi,
                "rows": chunk.rows_planned,
            },
        )

    def stored_plan(self, conn: Any, run_key: str) -> list[ChunkSpec]:
        rows = dbapi.fetch_all(
            conn,
            f"SELECT chunk_key, seq, tenants, lo, hi, rows_planned, partition, partition_oid, action"
            f" FROM {self.s}.chunks WHERE run_key = %(k)s ORDER BY seq NULLS LAST, chunk_key",
            {"k": run_key},
        )
        return [
            ChunkSpec(
                key=k,
                seq=seq,
                tenants=tuple(t) if t is not None else None,
                lo=lo,
                hi=hi,
                rows_planned=n,
                partition=part,
                partition_oid=oid,
                action=action,
            )
            for k, seq, t, lo, hi, n, part, oid, action in rows
        ]

    def chunk_rows(self, conn: Any, run_key: str) -> list[dict[str, Any]]:
        rows = dbapi.fetch_all(
            conn,
            f"SELECT {_CHUNK_COLUMNS} FROM {self.s}.chunks WHERE run_key = %(k)s ORDER BY seq NULLS LAST, chunk_key",
            {"k": run_key},
        )
        return [dict(zip(_CHUNK_FIELDS, row, strict=True)) for row in rows]

    def recent_batch_size(self, conn: Any, run_key: str) -> int | None:
        """The batch size the run's most recent batch settled on: a new chunk starts from it."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT last_batch_size FROM {self.s}.chunks WHERE run_key = %(k)s AND last_batch_size IS NOT NULL"
            " ORDER BY last_batch_at DESC LIMIT 1",
            {"k": run_key},
        )
        return int(rows[0][0]) if rows else None

    # -- progress, inside the engine's batch transaction ------------------------------------------

    def lock_chunk(self, cur: Any, run_key: str, chunk_key: str) -> tuple[Any, ...] | None:
        """Lock the chunk's row for the rest of the transaction: attempts of one chunk serialise here.
        Returns (state, next_key, lo, hi, tenants, rows_deleted, tenant_pos, partition, partition_oid,
        action, action_started_at) or None when there is no such row. ``tenant_pos`` is the index of the
        tenant a packed chunk is working on."""
        return self._chunk_row(cur, run_key, chunk_key, " FOR UPDATE")

    def read_chunk(self, cur: Any, run_key: str, chunk_key: str) -> tuple[Any, ...] | None:
        """The same row as :meth:`lock_chunk`, without waiting for or taking its lock."""
        return self._chunk_row(cur, run_key, chunk_key, "")

    def _chunk_row(self, cur: Any, run_key: str, chunk_key: str, locking: str) -> tuple[Any, ...] | None:
        cur.execute(
            "SELECT state, next_key, lo, hi, tenants, rows_deleted, tenant_pos, partition, partition_oid, action,"
            f" action_started_at FROM {self.s}.chunks WHERE run_key = %(r)s AND chunk_key = %(c)s{locking}",
            {"r": run_key, "c": chunk_key},
        )
        return cur.fetchone()

    def record_batch(
        self,
        cur: Any,
        run_key: str,
        chunk_key: str,
        *,
        next_key: int,
        tenant_pos: int,
        batch_size: int,
        backoffs: int,
        backoff_seconds: float,
        deleted: int,
        archived: int,
        matched: int,
        complete: bool,
        outcome: str | None,
        attempt: Attempt,
        first_batch_of_attempt: bool,
        paused: Mapping[str, float] | None = None,
    ) -> None:
        cur.execute(
            f"UPDATE {self.s}.chunks SET next_key = %(next)s::bigint, tenant_pos = %(pos)s::integer,"
            f" paused = {_ADD_PAUSED},"
            " last_batch_size = %(size)s::integer,"
            " min_batch_size = least(min_batch_size, %(size)s::integer),"
            " max_batch_size = greatest(max_batch_size, %(size)s::integer),"
            " backoffs = backoffs + %(backoffs)s::integer,"
            " backoff_seconds = backoff_seconds + %(backoff_s)s::double precision,"
            " rows_deleted = rows_deleted + %(deleted)s::bigint,"
            " rows_archived = rows_archived + %(archived)s::bigint,"
            " rows_matched = rows_matched + %(matched)s::bigint,"
            " batches = batches + 1, last_batch_rows = %(batch_rows)s::integer,"
            " attempts = attempts + %(new_attempt)s::integer,"
            " first_started_at = coalesce(first_started_at, now()), last_batch_at = clock_timestamp(),"
            " state = CASE WHEN %(complete)s::boolean THEN 'complete' ELSE 'running' END,"
            " completed_at = CASE WHEN %(complete)s::boolean THEN clock_timestamp() END,"
            " outcome = %(outcome)s::text,"
            " completed_dag_id = CASE WHEN %(complete)s::boolean THEN %(dag_id)s::text END,"
            " completed_run_id = CASE WHEN %(complete)s::boolean THEN %(run_id)s::text END,"
            " completed_map_index = CASE WHEN %(complete)s::boolean THEN %(map_index)s::integer END,"
            " completed_try_number = CASE WHEN %(complete)s::boolean THEN %(try_number)s::integer END,"
            " completed_host = CASE WHEN %(complete)s::boolean THEN %(host)s::text END,"
            " last_host = %(host)s::text, last_error = NULL"
            " WHERE run_key = %(r)s AND chunk_key = %(c)s AND state <> 'complete'",
            {
                "r": run_key,
                "c": chunk_key,
                "next": next_key,
                "pos": tenant_pos,
                "size": batch_size,
                "backoffs": backoffs,
                "backoff_s": backoff_seconds,
                "deleted": deleted,
                "archived": archived,
                "matched": matched,
                "batch_rows": deleted if not matched else matched,
                "new_attempt": 1 if first_batch_of_attempt else 0,
                "complete": complete,
                "outcome": outcome,
                "dag_id": attempt.dag_id,
                "run_id": attempt.run_id,
                "map_index": attempt.map_index,
                "try_number": attempt.try_number,
                "host": attempt.host,
                "paused": json.dumps(dict(paused or {})),
            },
        )
        if cur.rowcount != 1:
            # Impossible while we hold the row lock; refuse to commit a batch the ledger did not record.
            raise PermanentError(f"chunk {chunk_key} of run {run_key} vanished or completed under its lock")

    def complete_chunk(
        self,
        cur: Any,
        run_key: str,
        chunk: ChunkSpec,
        attempt: Attempt,
        *,
        outcome: str,
        deleted: int = 0,
        matched: int = 0,
        first_batch_of_attempt: bool = True,
    ) -> None:
        """Complete a chunk in one step, not by batches: a partition detached, dropped or counted (dry
        run), or a partition that is gone or kept."""
        self.record_batch(
            cur,
            run_key,
            chunk.key,
            next_key=chunk.hi,
            tenant_pos=0,
            batch_size=0,
            backoffs=0,
            backoff_seconds=0.0,
            deleted=deleted,
            archived=0,
            matched=matched,
            complete=True,
            outcome=outcome,
            attempt=attempt,
            first_batch_of_attempt=first_batch_of_attempt,
        )

    # -- partition actions and failed attempts ---------------------------------------------------

    def start_action(self, cur: Any, run_key: str, chunk_key: str, attempt: Attempt) -> None:
        """Record that the partition's detach is this chunk's, once that is known (the plain detach's own
        transaction, after ``DETACH … CONCURRENTLY`` returned, or left the partition pending): a retry
        that finds the partition detached treats the detach as its own only from this."""
        cur.execute(
            f"UPDATE {self.s}.chunks SET action_started_at = coalesce(action_started_at, clock_timestamp()),"
            " state = 'running', attempts = attempts + 1, first_started_at = coalesce(first_started_at, now()),"
            " last_host = %(host)s::text WHERE run_key = %(r)s AND chunk_key = %(c)s AND state <> 'complete'",
            {"r": run_key, "c": chunk_key, "host": attempt.host},
        )

    def record_error(
        self,
        conn: Any,
        run_key: str,
        chunk_key: str,
        message: str,
        lock_timeout_ms: int,
        *,
        backoffs: int = 0,
        backoff_seconds: float = 0.0,
        paused: Mapping[str, float] | None = None,
    ) -> None:
        """Best effort, in a transaction of its own: the batch that failed has been rolled back. Gives up
        after ``lock_timeout_ms`` when another attempt holds the row: the error still reaches the caller.
        ``paused``: the database budget's pauses since the last batch recorded (an attempt that gives up
        paused has no next batch to record them with)."""
        try:
            with dbapi.transaction(conn) as cur:
                dbapi.set_local_timeouts(cur, lock_timeout_ms, max(lock_timeout_ms, 1000))
                cur.execute(
                    f"UPDATE {self.s}.chunks SET last_error = %(m)s, backoffs = backoffs + %(b)s::integer,"
                    f" backoff_seconds = backoff_seconds + %(bs)s::double precision, paused = {_ADD_PAUSED}"
                    " WHERE run_key = %(r)s AND chunk_key = %(c)s",
                    {
                        "m": message[:2000],
                        "r": run_key,
                        "c": chunk_key,
                        "b": backoffs,
                        "bs": backoff_seconds,
                        "paused": json.dumps(dict(paused or {})),
                    },
                )
        except Exception:  # noqa: BLE001 - the connection may be the thing that failed
            pass
