"""The ledger's tables in one schema of the target database: their version (:data:`SCHEMA_VERSION`), the
migrations that create them and bring them up to date, and :class:`LedgerSchema`, the base of every part
of :class:`~airflow_retention.core.ledger.ledger.Ledger`: the schema it works in, quoted for the
statements, with :meth:`~LedgerSchema.version` and :meth:`~LedgerSchema.ensure`.
"""

from __future__ import annotations

from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.identifiers import check_ident, quote_ident

SCHEMA_VERSION = 8

MIGRATION_LOCK_TIMEOUT_MS = 30_000

# Each step moves the ledger from version N-1 to N. Steps only ever get appended.
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
    # A partitioned table with more leaves to purge than the chunk budget (Airflow's max_map_length): the
    # leaves a run's plan left for later runs, so that its record says what it did not cover. NULL for the
    # runs recorded before (not known); an empty array when the plan covered every leaf with rows.
    7: """
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS leaves_deferred text[];
""",
    # The database budget: the controller's state shared by every worker of every purge on the database
    # (one row), the canary it times, its observations (the chart of pressure beside cleanup), and each
    # chunk's time paused per reason.
    8: """
CREATE TABLE IF NOT EXISTS {s}.budget_state (
    scope              text PRIMARY KEY,
    level              integer NOT NULL,
    quiet              integer NOT NULL DEFAULT 0,
    paused             boolean NOT NULL DEFAULT false,
    concurrency        integer NOT NULL,
    duty               double precision NOT NULL,
    baseline_ms        double precision,
    baseline_at        timestamptz,
    canary_ms          double precision,
    reasons            text[] NOT NULL DEFAULT '{{}}',
    causes             text[] NOT NULL DEFAULT '{{}}',
    signals            jsonb NOT NULL DEFAULT '{{}}',
    observed_at        timestamptz,
    claimed_until      timestamptz,
    observer           text
);
CREATE TABLE IF NOT EXISTS {s}.budget_canary (
    scope              text PRIMARY KEY,
    at                 timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.budget_observations (
    at                 timestamptz NOT NULL DEFAULT clock_timestamp(),
    scope              text NOT NULL,
    level              integer NOT NULL,
    concurrency        integer NOT NULL,
    duty               double precision NOT NULL,
    paused             boolean NOT NULL,
    move               text NOT NULL,
    canary_ms          double precision,
    baseline_ms        double precision,
    slots_busy         integer,
    signals            jsonb NOT NULL,
    reasons            text[] NOT NULL,
    observer           text
);
CREATE INDEX IF NOT EXISTS budget_observations_at ON {s}.budget_observations (at);
ALTER TABLE {s}.chunks ADD COLUMN IF NOT EXISTS paused jsonb NOT NULL DEFAULT '{{}}';
""",
}


class LedgerSchema:
    """The ledger tables of one schema: its name (``schema``), quoted (``s``) for the statements, and
    their creation and migration."""

    def __init__(self, schema: str = "retention") -> None:
        self.schema = check_ident(schema)
        self.s = quote_ident(self.schema)

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
