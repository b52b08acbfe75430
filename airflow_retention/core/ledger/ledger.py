"""The ledger: runs and chunks of every purge, kept in the target database.

It lives next to the data because an Airflow 3 task cannot reach the metadata database, and because
a batch's ledger update must commit in the same transaction as its DELETE. Every statement on the
ledger is here. The columns are documented in ``docs/ledger.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.identifiers import TableName, check_ident, display_name, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)

SCHEMA_VERSION = 6

# Each step moves the ledger from version N-1 to N. Steps only ever get appended.
MIGRATION_LOCK_TIMEOUT_MS = 30_000

_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE IF NOT EXISTS {s}.runs (
    run_key            text PRIMARY KEY,
    policy             text NOT NULL,
    target_table       text NOT NULL,
    cutoff             timestamptz NOT NULL,
    dry_run            boolean NOT NULL DEFAULT false,
    state              text NOT NULL CHECK (state IN ('planned', 'complete')),
    chunk_rows         bigint NOT NULL,
    batch_size         integer NOT NULL,
    chunks_expected    integer NOT NULL,
    rows_planned       bigint NOT NULL,
    planned_at         timestamptz NOT NULL DEFAULT now(),
    planned_by         text,
    completed_at       timestamptz,
    chunks_completed   integer,
    rows_deleted       bigint,
    rows_archived      bigint,
    rows_matched       bigint,
    verified_by        text
);
CREATE TABLE IF NOT EXISTS {s}.chunks (
    run_key            text NOT NULL REFERENCES {s}.runs (run_key) ON DELETE CASCADE,
    chunk_key          text NOT NULL,
    seq                integer,
    tenants            text[],
    lo                 bigint NOT NULL,
    hi                 bigint NOT NULL,
    rows_planned       bigint,
    state              text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'running', 'complete')),
    next_key           bigint NOT NULL,
    rows_deleted       bigint NOT NULL DEFAULT 0,
    rows_archived      bigint NOT NULL DEFAULT 0,
    rows_matched       bigint NOT NULL DEFAULT 0,
    batches            integer NOT NULL DEFAULT 0,
    last_batch_rows    integer,
    attempts           integer NOT NULL DEFAULT 0,
    first_started_at   timestamptz,
    last_batch_at      timestamptz,
    completed_at       timestamptz,
    completed_dag_id   text,
    completed_run_id   text,
    completed_map_index integer,
    completed_try_number integer,
    completed_host     text,
    last_host          text,
    outcome            text CHECK (outcome IN ('deleted', 'nothing_to_delete', 'dry_run')),
    last_error         text,
    PRIMARY KEY (run_key, chunk_key),
    CHECK (lo < hi),
    CHECK (next_key BETWEEN lo AND hi)
);
CREATE INDEX IF NOT EXISTS chunks_incomplete ON {s}.chunks (run_key) WHERE state <> 'complete';
CREATE INDEX IF NOT EXISTS runs_policy_cutoff ON {s}.runs (policy, cutoff DESC);
""",
    # Adaptive batches, throttling, per-tenant progress in packed chunks, cleanup lag, vacuum.
    2: """
ALTER TABLE {s}.runs
    ADD COLUMN IF NOT EXISTS oldest_eligible_at timestamptz,
    ADD COLUMN IF NOT EXISTS eligible_left bigint,
    ADD COLUMN IF NOT EXISTS cleanup_lag_seconds double precision,
    ADD COLUMN IF NOT EXISTS lag_measured_at timestamptz,
    ADD COLUMN IF NOT EXISTS vacuumed_at timestamptz;
ALTER TABLE {s}.chunks
    ADD COLUMN IF NOT EXISTS tenant_pos integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_batch_size integer,
    ADD COLUMN IF NOT EXISTS min_batch_size integer,
    ADD COLUMN IF NOT EXISTS max_batch_size integer,
    ADD COLUMN IF NOT EXISTS backoffs integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS backoff_seconds double precision NOT NULL DEFAULT 0;
""",
    # Partitioned tables: a chunk names its partition (block ranges of a leaf, or a whole partition
    # detached or dropped); partition chunks record when their detach began and what became of them.
    3: """
ALTER TABLE {s}.chunks
    ADD COLUMN IF NOT EXISTS partition text,
    ADD COLUMN IF NOT EXISTS partition_oid bigint,
    ADD COLUMN IF NOT EXISTS action text,
    ADD COLUMN IF NOT EXISTS action_started_at timestamptz;
ALTER TABLE {s}.chunks DROP CONSTRAINT IF EXISTS chunks_outcome_check;
ALTER TABLE {s}.chunks DROP CONSTRAINT IF EXISTS chunks_action_check;
ALTER TABLE {s}.chunks
    ADD CONSTRAINT chunks_outcome_check CHECK (outcome IN ('deleted', 'nothing_to_delete', 'dry_run', 'detached',
        'dropped', 'kept', 'partition_gone')),
    ADD CONSTRAINT chunks_action_check CHECK (action IN ('detach', 'drop'));
""",
    # Tenants in one pass: rows per tenant per chunk, written by each batch in its own transaction, and
    # each run's frozen per-tenant cutoffs.
    4: """
CREATE TABLE IF NOT EXISTS {s}.tenant_counts (
    run_key            text NOT NULL,
    chunk_key          text NOT NULL,
    tenant             text NOT NULL,
    rows_deleted       bigint NOT NULL DEFAULT 0,
    rows_archived      bigint NOT NULL DEFAULT 0,
    rows_matched       bigint NOT NULL DEFAULT 0,
    batches            integer NOT NULL DEFAULT 0,
    first_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_key, chunk_key, tenant),
    FOREIGN KEY (run_key, chunk_key) REFERENCES {s}.chunks (run_key, chunk_key) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS {s}.tenant_cutoffs (
    run_key            text NOT NULL REFERENCES {s}.runs (run_key) ON DELETE CASCADE,
    tenant             text NOT NULL,
    retention          text NOT NULL,
    cutoff             timestamptz NOT NULL,
    source             text NOT NULL CHECK (source IN ('policy', 'table')),
    PRIMARY KEY (run_key, tenant)
);
CREATE TABLE IF NOT EXISTS {s}.dead_letters (
    run_key            text NOT NULL,
    chunk_key          text NOT NULL,
    tenant             text NOT NULL,
    cutoff             timestamptz NOT NULL,
    lo                 bigint NOT NULL,
    hi                 bigint NOT NULL,
    failure_class      text NOT NULL,
    sqlstate           text,
    message            text NOT NULL,
    attempts           integer NOT NULL DEFAULT 1,
    first_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolved_at        timestamptz,
    PRIMARY KEY (run_key, chunk_key, tenant),
    FOREIGN KEY (run_key, chunk_key) REFERENCES {s}.chunks (run_key, chunk_key) ON DELETE CASCADE
);
""",
    # The run's date beside its cutoff: per-tenant cutoffs are frozen from it, and months do not let the
    # cutoff tell it back (runs of 03-28 to 03-31 share the cutoff 02-28 of "1 month"). NULL for runs
    # recorded before, and for a run given only a cutoff that does not tell its date.
    # Before version 5, action_started_at was set *before* DETACH ... CONCURRENTLY; from 5 on it means
    # "this chunk's detach is known to be its own". An unfinished chunk's old mark is not that proof: a
    # partition a DBA detached after such a failed attempt would be dropped. Cleared, the retry treats a
    # detached partition as someone else's (kept, never dropped): the safe side.
    5: """
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS run_date timestamptz;
UPDATE {s}.chunks SET action_started_at = NULL WHERE state <> 'complete' AND action_started_at IS NOT NULL;
""",
    # A plan that failed once the ledger existed (a lock or statement timeout while sampling, a tenant
    # retention table with a bad value): no run row records it, so `status` and the view read it here.
    6: """
CREATE TABLE IF NOT EXISTS {s}.plan_failures (
    policy             text NOT NULL,
    run_key            text NOT NULL,
    cutoff             timestamptz NOT NULL,
    error              text NOT NULL,
    failed_by          text,
    attempts           integer NOT NULL DEFAULT 1,
    first_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    failed_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (policy, run_key)
);
""",
}


@dataclass(frozen=True)
class Attempt:
    """Who is doing the work: recorded on the chunk that an attempt completes."""

    dag_id: str | None = None
    run_id: str | None = None
    map_index: int | None = None
    try_number: int | None = None
    host: str | None = None

    def label(self) -> str:
        if self.dag_id is None:
            return self.host or "outside Airflow"
        return f"{self.dag_id}/{self.run_id}/{self.map_index}/try {self.try_number}"


class Ledger:
    """Statements on the ledger tables of one schema."""

    def __init__(self, schema: str = "retention") -> None:
        self.schema = check_ident(schema)
        self.s = quote_ident(self.schema)

    # -- creation and migration -------------------------------------------------------------------

    def version(self, conn: Any) -> int | None:
        rows = dbapi.fetch_all(
            conn,
            "SELECT to_regclass(%(t)s) IS NOT NULL",
            {"t": f"{self.s}.ledger_version"},
        )
        if not rows[0][0]:
            return None
        return int(dbapi.fetch_all(conn, f"SELECT version FROM {self.s}.ledger_version")[0][0])

    def ensure(self, conn: Any) -> int:
        """Create or migrate the ledger; safe under concurrent callers. Returns the schema version.

        An up-to-date ledger is only read, so a role without CREATE can run purges once an administrator
        has created it (for instance with one planner run as the owner).
        """
        current = self.version(conn)
        if current == SCHEMA_VERSION:
            return current
        if current is not None and current > SCHEMA_VERSION:
            raise PermanentError(
                f"ledger schema {self.schema!r} is at version {current}, newer than this airflow-retention"
                f" ({SCHEMA_VERSION}); upgrade the package"
            )
        with dbapi.transaction(conn) as cur:
            # Concurrent creators queue on this lock; IF NOT EXISTS alone races on the catalog.
            cur.execute("SELECT pg_advisory_xact_lock(hashtext(%(k)s))", {"k": f"airflow_retention:{self.schema}"})
            # A migration's ALTER TABLE waits for every open reader of the ledger (a `status`, the view),
            # and every ledger user queues behind it: bounded, a timeout fails retryably.
            cur.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT_MS}ms'")
            # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema is there.
            cur.execute("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(n)s", {"n": self.schema})
            if cur.fetchone() is None:
                cur.execute(f"CREATE SCHEMA {self.s}")
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {self.s}.ledger_version ("
                " singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
                " version integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now())"
            )
            cur.execute(f"SELECT version FROM {self.s}.ledger_version")
            row = cur.fetchone()
            version = row[0] if row else 0
            for step in range(version + 1, SCHEMA_VERSION + 1):
                cur.execute(_MIGRATIONS[step].format(s=self.s))
            cur.execute(
                f"INSERT INTO {self.s}.ledger_version (version) VALUES (%(v)s::integer)"
                " ON CONFLICT (singleton) DO UPDATE SET version = EXCLUDED.version, migrated_at = now()",
                {"v": SCHEMA_VERSION},
            )
        return SCHEMA_VERSION

    # -- runs ------------------------------------------------------------------------------------

    def register_run(self, cur: Any, run: RunRecord, *, complete_if_empty: bool = True) -> bool:
        """Insert the run if it is new; return whether this call created it. A planned run with no
        chunks is complete at once (nothing was eligible)."""
        empty_and_done = complete_if_empty and run.chunks_expected == 0
        cur.execute(
            f"INSERT INTO {self.s}.runs (run_key, policy, target_table, cutoff, dry_run, state, chunk_rows,"
            " batch_size, chunks_expected, rows_planned, planned_by, run_date)"
            " VALUES (%(run_key)s, %(policy)s, %(table)s, %(cutoff)s::timestamptz, %(dry_run)s::boolean,"
            " %(state)s, %(chunk_rows)s::bigint, %(batch_size)s::integer, %(chunks)s::integer,"
            " %(rows)s::bigint, %(by)s, %(run_date)s::timestamptz)"
            " ON CONFLICT (run_key) DO NOTHING RETURNING run_key",
            {
                "run_key": run.run_key,
                "policy": run.policy,
                "table": run.target_table,
                "cutoff": run.cutoff,
                "dry_run": run.dry_run,
                "state": "complete" if empty_and_done else "planned",
                "chunk_rows": run.chunk_rows,
                "batch_size": run.batch_size,
                "chunks": run.chunks_expected,
                "rows": run.rows_planned,
                "by": run.planned_by,
                "run_date": run.run_date,
            },
        )
        created = cur.fetchone() is not None
        if created and empty_and_done:
            cur.execute(
                f"UPDATE {self.s}.runs SET completed_at = now(), chunks_completed = 0, rows_deleted = 0,"
                " rows_archived = 0, rows_matched = 0, verified_by = %(by)s WHERE run_key = %(run_key)s",
                {"run_key": run.run_key, "by": run.planned_by},
            )
        return created

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

    def get_run(self, conn: Any, run_key: str) -> dict[str, Any] | None:
        rows = dbapi.fetch_all(conn, f"SELECT {_RUN_COLUMNS} FROM {self.s}.runs WHERE run_key = %(k)s", {"k": run_key})
        return dict(zip(_RUN_FIELDS, rows[0], strict=True)) if rows else None

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

    def complete_run(self, conn: Any, run_key: str, verified_by: str | None) -> dict[str, Any]:
        """Mark a run complete with totals summed from its chunks; the first verification wins."""
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"UPDATE {self.s}.runs r SET state = 'complete', completed_at = coalesce(r.completed_at, now()),"
                " chunks_completed = t.chunks, rows_deleted = t.deleted, rows_archived = t.archived,"
                " rows_matched = t.matched, verified_by = coalesce(r.verified_by, %(by)s)"
                " FROM (SELECT count(*) FILTER (WHERE state = 'complete') AS chunks,"
                "              coalesce(sum(rows_deleted), 0) AS deleted,"
                "              coalesce(sum(rows_archived), 0) AS archived,"
                "              coalesce(sum(rows_matched), 0) AS matched"
                f"       FROM {self.s}.chunks WHERE run_key = %(k)s) t"
                " WHERE r.run_key = %(k)s",
                {"k": run_key, "by": verified_by},
            )
        run = self.get_run(conn, run_key)
        assert run is not None
        return run

    def recent_runs(self, conn: Any, policy: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The latest ``limit`` runs (of one policy, or of all), returned per policy, oldest cutoff first."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT {_RUN_COLUMNS} FROM {self.s}.runs"
            f" WHERE run_key IN (SELECT run_key FROM {self.s}.runs WHERE %(p)s::text IS NULL OR policy = %(p)s::text"
            "   ORDER BY cutoff DESC, planned_at DESC LIMIT %(n)s::integer)"
            " ORDER BY policy, cutoff, planned_at",
            {"p": policy, "n": limit},
        )
        return [dict(zip(_RUN_FIELDS, row, strict=True)) for row in rows]

    def policies(self, conn: Any) -> list[str]:
        """Every policy with a run in this ledger."""
        return [r[0] for r in dbapi.fetch_all(conn, f"SELECT DISTINCT policy FROM {self.s}.runs ORDER BY 1")]

    def recent_batch_size(self, conn: Any, run_key: str) -> int | None:
        """The batch size the run's most recent batch settled on: a new chunk starts from it."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT last_batch_size FROM {self.s}.chunks WHERE run_key = %(k)s AND last_batch_size IS NOT NULL"
            " ORDER BY last_batch_at DESC LIMIT 1",
            {"k": run_key},
        )
        return int(rows[0][0]) if rows else None

    def measured_rate(self, conn: Any, policy: str, *, dry_run: bool, blocks: bool) -> MeasuredRate | None:
        """How fast the policy's chunks went in its previous runs: rows and blocks over seconds of its
        latest :data:`RATE_SAMPLE_CHUNKS` chunks completed in one attempt, of the same kind (block
        ranges or key ranges) and mode (dry run or not), from the first batch to completion, less
        throttle pauses. None without such chunks, or with under a second of them (too few to tell)."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT count(*), coalesce(sum(rows), 0), coalesce(sum(blocks), 0), coalesce(sum(seconds), 0)"
            " FROM (SELECT c.rows_deleted + c.rows_matched AS rows, c.hi - c.lo AS blocks,"
            "   greatest(extract(epoch FROM c.completed_at - c.first_started_at) - c.backoff_seconds, 0) AS seconds"
            f" FROM {self.s}.chunks c JOIN {self.s}.runs r USING (run_key)"
            " WHERE r.policy = %(p)s::text AND r.dry_run = %(d)s::boolean AND c.state = 'complete'"
            " AND c.action IS NULL AND c.attempts = 1 AND c.first_started_at IS NOT NULL"
            " AND c.completed_at IS NOT NULL AND (c.chunk_key LIKE %(prefix)s::text) = %(blocks)s::boolean"
            " ORDER BY c.completed_at DESC LIMIT %(n)s::integer) recent",
            {"p": policy, "d": dry_run, "prefix": BLOCK_CHUNK_PREFIX + "%", "blocks": blocks, "n": RATE_SAMPLE_CHUNKS},
        )
        chunks, n_rows, n_blocks, seconds = rows[0]
        if not chunks or float(seconds) < MIN_RATE_SECONDS:
            return None
        return MeasuredRate(int(chunks), int(n_rows), int(n_blocks) if blocks else None, float(seconds))

    def record_cleanup_lag(
        self, conn: Any, run_key: str, *, oldest: datetime | None, left: int, lag_seconds: float
    ) -> None:
        """What the run left behind: the oldest eligible row, how many (capped), how overdue."""
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"UPDATE {self.s}.runs SET oldest_eligible_at = %(o)s::timestamptz, eligible_left = %(n)s::bigint,"
                " cleanup_lag_seconds = %(lag)s::double precision, lag_measured_at = now() WHERE run_key = %(k)s",
                {"k": run_key, "o": oldest, "n": left, "lag": lag_seconds},
            )

    def lag_pending(self, conn: Any, policy: str, dry_run: bool) -> dict[str, Any] | None:
        """The policy's latest complete planned run (of this mode) when its cleanup lag is not measured
        yet; None when it is, or when there is no such run."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT {_RUN_COLUMNS} FROM {self.s}.runs WHERE policy = %(p)s AND dry_run = %(d)s"
            " AND state = 'complete' AND run_key NOT LIKE '%%#lone' ORDER BY completed_at DESC NULLS LAST LIMIT 1",
            {"p": policy, "d": dry_run},
        )
        run = dict(zip(_RUN_FIELDS, rows[0], strict=True)) if rows else None
        return run if run is not None and run["lag_measured_at"] is None else None

    def lag_window_start(
        self, conn: Any, policy: str, dry_run: bool, run_key: str, cutoff: datetime
    ) -> datetime | None:
        """Where the walk for the cleanup lag of ``run_key`` may start: the earliest of the cutoff, the
        tenants' cutoffs and the oldest row left of the policy's latest earlier run whose lag was
        measured. Every row older than that was eligible when that run was measured, so it was deleted
        or counted then. None (walk from the oldest row) without such a run."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT least(r.cutoff, r.oldest_eligible_at,"
            f"             (SELECT min(t.cutoff) FROM {self.s}.tenant_cutoffs t WHERE t.run_key = r.run_key))"
            f" FROM {self.s}.runs r WHERE r.policy = %(p)s AND r.dry_run = %(d)s AND r.state = 'complete'"
            " AND r.lag_measured_at IS NOT NULL AND r.run_key <> %(k)s AND r.run_key NOT LIKE '%%#lone'"
            " AND r.cutoff <= %(c)s::timestamptz ORDER BY r.cutoff DESC, r.completed_at DESC LIMIT 1",
            {"p": policy, "d": dry_run, "k": run_key, "c": cutoff},
        )
        return rows[0][0] if rows else None

    def record_vacuum(self, conn: Any, run_key: str) -> None:
        with dbapi.transaction(conn) as cur:
            cur.execute(f"UPDATE {self.s}.runs SET vacuumed_at = now() WHERE run_key = %(k)s", {"k": run_key})

    def prune(self, conn: Any, policy: str, keep_days: int) -> int:
        """Delete the policy's runs (and their chunks) last touched more than ``keep_days`` ago (by their
        planning or completion time, not their cutoff: a backfill of an old date is kept like any run)."""
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"DELETE FROM {self.s}.runs WHERE policy = %(p)s"
                " AND coalesce(completed_at, planned_at) < now() - make_interval(days => %(d)s::integer)",
                {"p": policy, "d": keep_days},
            )
            pruned = int(cur.rowcount)
        try:
            with dbapi.transaction(conn) as cur:
                cur.execute(
                    f"DELETE FROM {self.s}.plan_failures WHERE policy = %(p)s"
                    " AND failed_at < now() - make_interval(days => %(d)s::integer)",
                    {"p": policy, "d": keep_days},
                )
        except Exception:
            log.warning("could not prune the failed plans of policy %s", policy, exc_info=True)
        return pruned

    # -- plan failures: what a plan that raised leaves behind ------------------------------------

    def record_plan_failure(
        self, conn: Any, policy: str, run_key: str, cutoff: datetime, error: str, failed_by: str | None
    ) -> bool:
        """Record (or count again) a failed plan of ``run_key``, in a transaction of its own, when the
        ledger exists at a version that has the table; never raises (the plan's own error is the one that
        matters). Returns whether it was recorded."""
        try:
            conn.rollback()  # the failed plan may have left its transaction open
            version = self.version(conn)
            if version is None or version < 6:
                return False
            with dbapi.transaction(conn) as cur:
                cur.execute(
                    f"INSERT INTO {self.s}.plan_failures (policy, run_key, cutoff, error, failed_by)"
                    " VALUES (%(p)s, %(k)s, %(c)s::timestamptz, left(%(e)s, 2000), %(by)s)"
                    " ON CONFLICT (policy, run_key) DO UPDATE SET error = EXCLUDED.error,"
                    " failed_by = EXCLUDED.failed_by, attempts = plan_failures.attempts + 1,"
                    " failed_at = clock_timestamp()",
                    {"p": policy, "k": run_key, "c": cutoff, "e": error, "by": failed_by},
                )
            return True
        except Exception:
            log.warning("could not record the failed plan of %s in the ledger", run_key, exc_info=True)
            return False

    def latest_plan_failure(self, conn: Any, policy: str) -> dict[str, Any] | None:
        """The policy's most recent failed plan (run_key, cutoff, error, failed_by, attempts, first_at,
        failed_at), or None; None too on a ledger older than version 6."""
        version = self.version(conn)
        if version is None or version < 6:
            return None
        fields = ("run_key", "cutoff", "error", "failed_by", "attempts", "first_at", "failed_at")
        try:
            rows = dbapi.fetch_all(
                conn,
                f"SELECT {', '.join(fields)} FROM {self.s}.plan_failures WHERE policy = %(p)s"
                " ORDER BY failed_at DESC LIMIT 1",
                {"p": policy},
            )
        except PermanentError as exc:
            if "(SQLSTATE 42501)" not in str(exc):
                raise
            # A role not granted the table (an administrator migrated the ledger): the rest still reads.
            log.warning("no privilege on %s.plan_failures: failed plans are not shown", self.schema)
            return None
        return dict(zip(fields, rows[0], strict=True)) if rows else None

    def complete_cutoffs(
        self, conn: Any, policy: str, dry_run: bool, since: datetime, until: datetime
    ) -> set[datetime]:
        """Cutoffs of the policy's complete planned runs (of the same mode) in ``[since, until]``."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT cutoff FROM {self.s}.runs WHERE policy = %(p)s AND state = 'complete' AND dry_run = %(d)s"
            " AND cutoff BETWEEN %(a)s::timestamptz AND %(b)s::timestamptz AND run_key NOT LIKE '%%#lone'",
            {"p": policy, "d": dry_run, "a": since, "b": until},
        )
        return {row[0] for row in rows}

    def latest_complete_cutoff(self, conn: Any, policy: str, dry_run: bool) -> datetime | None:
        """The latest cutoff of the policy's complete planned runs of the same mode, or None."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT max(cutoff) FROM {self.s}.runs WHERE policy = %(p)s AND state = 'complete' AND dry_run = %(d)s"
            " AND run_key NOT LIKE '%%#lone'",
            {"p": policy, "d": dry_run},
        )
        return rows[0][0]

    # -- chunks, inside the engine's batch transaction --------------------------------------------

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
    ) -> None:
        cur.execute(
            f"UPDATE {self.s}.chunks SET next_key = %(next)s::bigint, tenant_pos = %(pos)s::integer,"
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

    def add_tenant_counts(self, cur: Any, run_key: str, chunk_key: str, rows: Sequence[tuple[Any, ...]]) -> None:
        """Add one batch's (tenant, deleted, archived, matched) rows to the chunk's per-tenant counts, in
        the batch's transaction: they commit, or roll back, with its DELETE."""
        if not rows:
            return
        cur.execute(
            f"INSERT INTO {self.s}.tenant_counts AS c (run_key, chunk_key, tenant, rows_deleted, rows_archived,"
            " rows_matched, batches)"
            " SELECT %(r)s, %(c)s, t, d, a, m, 1"
            " FROM unnest(%(t)s::text[], %(d)s::bigint[], %(a)s::bigint[], %(m)s::bigint[]) AS x(t, d, a, m)"
            " ON CONFLICT (run_key, chunk_key, tenant) DO UPDATE SET"
            " rows_deleted = c.rows_deleted + EXCLUDED.rows_deleted,"
            " rows_archived = c.rows_archived + EXCLUDED.rows_archived,"
            " rows_matched = c.rows_matched + EXCLUDED.rows_matched,"
            " batches = c.batches + 1, last_at = clock_timestamp()",
            {
                "r": run_key,
                "c": chunk_key,
                "t": [str(r[0]) for r in rows],
                "d": [int(r[1]) for r in rows],
                "a": [int(r[2]) for r in rows],
                "m": [int(r[3]) for r in rows],
            },
        )

    def tenant_counts(self, conn: Any, run_key: str) -> list[dict[str, Any]]:
        """Rows per tenant of a run, summed over its chunks, most deleted first."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT tenant, sum(rows_deleted)::bigint, sum(rows_archived)::bigint, sum(rows_matched)::bigint,"
            f" count(*)::integer FROM {self.s}.tenant_counts WHERE run_key = %(k)s"
            " GROUP BY tenant ORDER BY 2 DESC, 1",
            {"k": run_key},
        )
        return [
            {"tenant": t, "rows_deleted": d, "rows_archived": a, "rows_matched": m, "chunks": n}
            for t, d, a, m, n in rows
        ]

    def record_tenant_cutoffs(self, cur: Any, run_key: str, cutoffs: Sequence[tuple[str, str, datetime, str]]) -> None:
        """Freeze a run's per-tenant cutoffs (tenant, retention, cutoff, source) with its plan."""
        if not cutoffs:
            return
        cur.execute(
            f"INSERT INTO {self.s}.tenant_cutoffs (run_key, tenant, retention, cutoff, source)"
            " SELECT %(r)s, t, r, c, s"
            " FROM unnest(%(t)s::text[], %(rt)s::text[], %(c)s::timestamptz[], %(s)s::text[]) AS x(t, r, c, s)"
            " ON CONFLICT (run_key, tenant) DO NOTHING",
            {
                "r": run_key,
                "t": [c[0] for c in cutoffs],
                "rt": [c[1] for c in cutoffs],
                "c": [c[2] for c in cutoffs],
                "s": [c[3] for c in cutoffs],
            },
        )

    def tenant_cutoffs(self, conn: Any, run_key: str) -> list[tuple[str, str, datetime, str]]:
        """The run's frozen per-tenant cutoffs: (tenant, retention, cutoff, source), by tenant."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT tenant, retention, cutoff, source FROM {self.s}.tenant_cutoffs WHERE run_key = %(k)s"
            " ORDER BY tenant",
            {"k": run_key},
        )
        return [(t, r, c, s) for t, r, c, s in rows]

    def record_dead_letter(self, cur: Any, run_key: str, chunk: ChunkSpec, letter: DeadLetter) -> None:
        """A tenant whose rows of the chunk failed permanently: kept open until a retry purges them."""
        cur.execute(
            f"INSERT INTO {self.s}.dead_letters AS d (run_key, chunk_key, tenant, cutoff, lo, hi, failure_class,"
            " sqlstate, message) VALUES (%(r)s, %(c)s, %(t)s, %(cutoff)s::timestamptz, %(lo)s::bigint,"
            " %(hi)s::bigint, %(fc)s, %(st)s, %(m)s)"
            " ON CONFLICT (run_key, chunk_key, tenant) DO UPDATE SET attempts = d.attempts + 1,"
            " failure_class = EXCLUDED.failure_class, sqlstate = EXCLUDED.sqlstate, message = EXCLUDED.message,"
            " last_at = clock_timestamp(), resolved_at = NULL",
            {
                "r": run_key,
                "c": chunk.key,
                "t": letter.tenant,
                "cutoff": letter.cutoff,
                "lo": chunk.lo,
                "hi": chunk.hi,
                "fc": letter.failure_class,
                "st": letter.sqlstate,
                "m": letter.message[:2000],
            },
        )

    def add_redone_rows(self, cur: Any, run_key: str, chunk_key: str, deleted: int) -> None:
        """Rows a complete chunk deleted when it purged its dead-lettered tenants again."""
        cur.execute(
            f"UPDATE {self.s}.chunks SET rows_deleted = rows_deleted + %(n)s::bigint,"
            " outcome = CASE WHEN %(n)s::bigint > 0 THEN 'deleted' ELSE outcome END,"
            " last_batch_at = clock_timestamp() WHERE run_key = %(r)s AND chunk_key = %(c)s",
            {"r": run_key, "c": chunk_key, "n": deleted},
        )

    def resolve_dead_letters(self, cur: Any, run_key: str, chunk_key: str, tenants: Sequence[str]) -> None:
        cur.execute(
            f"UPDATE {self.s}.dead_letters SET resolved_at = clock_timestamp() WHERE run_key = %(r)s"
            " AND chunk_key = %(c)s AND tenant = ANY(%(t)s::text[]) AND resolved_at IS NULL",
            {"r": run_key, "c": chunk_key, "t": list(tenants)},
        )

    def open_dead_letters(self, cur: Any, run_key: str, chunk_key: str | None = None) -> list[dict[str, Any]]:
        """Unresolved dead letters of a run (of one chunk), oldest first."""
        cur.execute(
            "SELECT chunk_key, tenant, cutoff, lo, hi, failure_class, sqlstate, message, attempts, first_at,"
            f" last_at FROM {self.s}.dead_letters WHERE run_key = %(r)s AND resolved_at IS NULL"
            " AND (%(c)s::text IS NULL OR chunk_key = %(c)s::text) ORDER BY first_at, chunk_key, tenant",
            {"r": run_key, "c": chunk_key},
        )
        names = ("chunk_key", "tenant", "cutoff", "lo", "hi", "failure_class", "sqlstate", "message", "attempts",
                 "first_at", "last_at")  # fmt: skip
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def tenants_at_cap(self, cur: Any, run_key: str, cap: int) -> list[str]:
        """Tenants that have had at least ``cap`` rows deleted in the run: later batches leave them out."""
        cur.execute(
            f"SELECT tenant FROM {self.s}.tenant_counts WHERE run_key = %(k)s GROUP BY tenant"
            " HAVING sum(rows_deleted) >= %(cap)s::bigint ORDER BY tenant",
            {"k": run_key, "cap": cap},
        )
        return [r[0] for r in cur.fetchall()]

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
    ) -> None:
        """Best effort, in a transaction of its own: the batch that failed has been rolled back. Gives up
        after ``lock_timeout_ms`` when another attempt holds the row: the error still reaches the caller."""
        try:
            with dbapi.transaction(conn) as cur:
                dbapi.set_local_timeouts(cur, lock_timeout_ms, max(lock_timeout_ms, 1000))
                cur.execute(
                    f"UPDATE {self.s}.chunks SET last_error = %(m)s, backoffs = backoffs + %(b)s::integer,"
                    " backoff_seconds = backoff_seconds + %(bs)s::double precision"
                    " WHERE run_key = %(r)s AND chunk_key = %(c)s",
                    {"m": message[:2000], "r": run_key, "c": chunk_key, "b": backoffs, "bs": backoff_seconds},
                )
        except Exception:  # noqa: BLE001 - the connection may be the thing that failed
            pass


@dataclass(frozen=True)
class DeadLetter:
    """One tenant's rows of a chunk that failed for a reason a retry cannot fix (a foreign key, a
    privilege): the other tenants of the chunk are purged, this one is recorded and left."""

    tenant: str
    cutoff: datetime
    failure_class: str
    sqlstate: str | None
    message: str


# Chunk keys of policies with ``chunk_by: block`` start with this: their lo/hi are block numbers.
BLOCK_CHUNK_PREFIX = "blocks:"
# The planner's measured rate: the latest chunks of a policy, and at least this much of their time.
RATE_SAMPLE_CHUNKS = 64
MIN_RATE_SECONDS = 1.0


@dataclass(frozen=True)
class MeasuredRate:
    """Rows (deleted, or matched in a dry run) and blocks (block chunks only) a policy's recent chunks
    went through, in ``seconds`` of their time."""

    chunks: int
    rows: int
    blocks: int | None
    seconds: float

    @property
    def rows_per_s(self) -> float | None:
        return self.rows / self.seconds if self.rows else None

    @property
    def blocks_per_s(self) -> float | None:
        return self.blocks / self.seconds if self.blocks else None


def half_open(lo: int, hi: int) -> str:
    """A range as people read it everywhere (chunk labels, batch log lines): ``[lo, hi)``, the numbers
    of the chunk key and of the range parameters, never an inclusive ``lo-(hi-1)`` beside a key that
    says ``lo-hi``."""
    return f"[{lo}, {hi})"


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a plan: tenants (None: all rows) and the key range [lo, hi)."""

    key: str
    lo: int
    hi: int
    tenants: tuple[str, ...] | None = None
    seq: int | None = None
    rows_planned: int | None = None
    partition: str | None = None
    partition_oid: int | None = None
    action: str | None = None

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> ChunkSpec:
        """The chunk a row of :meth:`Ledger.chunk_rows` describes (to label it as the UI does)."""
        tenants = row["tenants"]
        return cls(
            key=row["chunk_key"],
            lo=row["lo"],
            hi=row["hi"],
            tenants=tuple(tenants) if tenants is not None else None,
            seq=row.get("seq"),
            rows_planned=row.get("rows_planned"),
            partition=row.get("partition"),
            partition_oid=row.get("partition_oid"),
            action=row.get("action"),
        )

    def label(self) -> str:
        """The one human notation of a chunk's range in the Airflow UI (the mapped task's label), the
        logs, the CLI and the docs: "ids [1, 25655)", "tenant 7 · ids [120000, 130000)",
        "events_2026_05 · blocks [0, 8192)", "drop events_2026_04". The range is half-open, first
        bound in, second out, with the numbers of the chunk key ("blocks:0-8192"), which is the ledger's
        identifier and is never reformatted, and of ``keys=(lo, hi)`` and ``blocks=(lo, hi)``."""
        leaf = TableName.parse(self.partition).name if self.partition else None
        if self.action is not None:
            return f"{self.action} {display_name(leaf or '?')}"
        if self.key.startswith(BLOCK_CHUNK_PREFIX) or self.partition is not None:
            blocks = f"blocks {half_open(self.lo, self.hi)}"
            return f"{display_name(leaf)} · {blocks}" if leaf else blocks
        ids = f"ids {half_open(self.lo, self.hi)}"
        if self.tenants is None:
            return ids
        if len(self.tenants) == 1:
            return f"tenant {self.tenants[0]} · {ids}"
        return f"{len(self.tenants)} tenants {self.tenants[0]}…{self.tenants[-1]} · {ids}"


@dataclass(frozen=True)
class RunRecord:
    run_key: str
    policy: str
    target_table: str
    cutoff: datetime
    dry_run: bool
    chunk_rows: int
    batch_size: int
    chunks_expected: int
    rows_planned: int
    planned_by: str | None
    run_date: datetime | None = None  # the run's date, the cutoff frozen from it; None when not known

    @classmethod
    def of(
        cls,
        policy: RetentionPolicy,
        run_key: str,
        cutoff: datetime,
        *,
        chunk_rows: int,
        chunks_expected: int,
        rows_planned: int,
        planned_by: str | None,
        run_date: datetime | None = None,
    ) -> RunRecord:
        return cls(
            run_key=run_key,
            policy=policy.name,
            target_table=str(policy.table),
            cutoff=cutoff,
            dry_run=policy.dry_run,
            chunk_rows=chunk_rows,
            batch_size=policy.batch_size,
            chunks_expected=chunks_expected,
            rows_planned=rows_planned,
            planned_by=planned_by,
            run_date=run_date,
        )


_RUN_FIELDS = (
    "run_key", "policy", "target_table", "cutoff", "dry_run", "state", "chunk_rows", "batch_size",
    "chunks_expected", "rows_planned", "planned_at", "planned_by", "completed_at", "chunks_completed",
    "rows_deleted", "rows_archived", "rows_matched", "verified_by", "oldest_eligible_at", "eligible_left",
    "cleanup_lag_seconds", "lag_measured_at", "vacuumed_at", "run_date",
)  # fmt: skip
# run_date (version 5) is read through the row's JSON, NULL on a ledger not migrated yet: the CLI's
# status and the UI read a ledger without migrating it, and must not fail on one of version 4.
_RUN_COLUMNS = ", ".join(_RUN_FIELDS[:-1]) + ", (to_jsonb(runs) ->> 'run_date')::timestamptz"
_CHUNK_FIELDS = (
    "run_key", "chunk_key", "seq", "tenants", "lo", "hi", "rows_planned", "state", "next_key",
    "rows_deleted", "rows_archived", "rows_matched", "batches", "attempts", "first_started_at",
    "last_batch_at", "completed_at", "completed_dag_id", "completed_run_id", "completed_map_index",
    "completed_try_number", "completed_host", "last_host", "outcome", "last_error", "tenant_pos",
    "last_batch_size", "min_batch_size", "max_batch_size", "backoffs", "backoff_seconds", "partition",
    "partition_oid", "action", "action_started_at",
)  # fmt: skip
_CHUNK_COLUMNS = ", ".join(_CHUNK_FIELDS)
