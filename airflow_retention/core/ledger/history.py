"""What a policy's past runs tell its next ones: the rate its chunks went at (the planner sizes chunks
by it), when they last covered each leaf of a partitioned table (the planner carries the leaves past its
chunk budget over), the cleanup lag each run left and its vacuum, and the plans that failed before any
run row recorded them (``plan_failures``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import BLOCK_CHUNK_PREFIX, MeasuredRate
from airflow_retention.core.ledger.runs import RUN_COLUMNS, RUN_FIELDS
from airflow_retention.core.ledger.schema import LedgerSchema

log = logging.getLogger(__name__)

# The planner's measured rate: the latest chunks of a policy, and at least this much of their time.
RATE_SAMPLE_CHUNKS = 64
MIN_RATE_SECONDS = 1.0
# Rows of a chunk ``c``: deleted, or matched in a dry run (the other is 0).
CHUNK_ROWS = "(c.rows_deleted + c.rows_matched)"
# The seconds a chunk ``c`` worked: its first batch to its last, less its throttle's backoffs and the
# database budget's pauses and rests (``paused``, by reason; it came with ledger version 8: read from the row
# as JSON, so that an older ledger reads as having paused nothing).
WORKED_SECONDS = (
    "greatest(extract(epoch FROM coalesce(c.completed_at, c.last_batch_at) - c.first_started_at)"
    " - c.backoff_seconds"
    " - coalesce((SELECT sum(p.value::float8) FROM jsonb_each_text(to_jsonb(c) -> 'paused') p), 0), 0)"
)


class LedgerHistory(LedgerSchema):
    """Measured rates, leaf coverage, cleanup lag, vacuums and failed plans of the ledger's policies."""

    def measured_rate(self, conn: Any, policy: str, *, dry_run: bool, blocks: bool) -> MeasuredRate | None:
        """How fast the policy's chunks went in its previous runs: rows and blocks over seconds of its
        latest :data:`RATE_SAMPLE_CHUNKS` chunks completed in one attempt, of the same kind (block
        ranges or key ranges) and mode (dry run or not), from the first batch to completion, less
        throttle pauses and the database budget's pauses and rests. None without such chunks, or with
        under a second of them (too few to tell).

        The rate is the chunks' own, not the budget's: counted with the budget's rests, one night held at a
        1 % duty cycle would measure a rate a hundred times lower, and the next plan would cut the same work
        into up to ``max_map_length`` chunks of a few hundred rows each, every one paying a task's cost."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT count(*), coalesce(sum(rows), 0), coalesce(sum(blocks), 0), coalesce(sum(seconds), 0)"
            f" FROM (SELECT {CHUNK_ROWS} AS rows, c.hi - c.lo AS blocks, {WORKED_SECONDS} AS seconds"
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

    def leaf_coverage(self, conn: Any, policy: str, *, dry_run: bool, oids: Sequence[int]) -> dict[int, datetime]:
        """When the policy's earlier planned runs (of the same mode) last covered each of the leaves
        ``oids``: per leaf, the latest cutoff of a run whose chunks on that leaf all completed without an
        open dead letter; a leaf no such run covered is left out. The planner plans first the leaves
        least recently covered when they do not all fit its chunk budget.

        The cutoff, not the completion time: a backfill of an old date, completed today, cleared the
        leaf only up to its own cutoff. Reads only, and works without a ledger (the plan preview of a
        policy never run): empty then, as on a ledger older than version 3 (no partition chunks), or
        when this role may not read the ledger (the plan falls back to the tree's order)."""
        version = self.version(conn)  # to_regclass: no ledger yet is no error
        if version is None or version < 3 or not oids:
            return {}
        try:
            rows = dbapi.fetch_all(
                conn,
                "SELECT partition_oid, max(cutoff) FROM ("
                "  SELECT c.partition_oid, r.cutoff"
                f"  FROM {self.s}.chunks c JOIN {self.s}.runs r USING (run_key)"
                "   WHERE r.policy = %(p)s::text AND r.dry_run = %(d)s::boolean AND r.run_key NOT LIKE '%%#lone'"
                "   AND c.action IS NULL AND c.partition_oid = ANY (%(oids)s::bigint[])"
                # A chunk that left tenants as dead letters is complete, yet did not purge its leaf.
                + (
                    f"   AND NOT EXISTS (SELECT 1 FROM {self.s}.dead_letters d WHERE d.run_key = c.run_key"
                    "    AND d.chunk_key = c.chunk_key AND d.resolved_at IS NULL)"
                    if version >= 4
                    else ""
                )
                + "   GROUP BY r.run_key, r.cutoff, c.partition_oid HAVING bool_and(c.state = 'complete')"
                ") covered GROUP BY partition_oid",
                {"p": policy, "d": dry_run, "oids": list(oids)},
            )
        except PermanentError as exc:
            if "(SQLSTATE 42501)" not in str(exc):
                raise
            log.warning(
                "no privilege on the ledger %s: leaves past the chunk budget are planned in the tree's order",
                self.schema,
            )
            return {}
        return {int(oid): cutoff for oid, cutoff in rows}

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
            f"SELECT {RUN_COLUMNS} FROM {self.s}.runs WHERE policy = %(p)s AND dry_run = %(d)s"
            " AND state = 'complete' AND run_key NOT LIKE '%%#lone' ORDER BY completed_at DESC NULLS LAST LIMIT 1",
            {"p": policy, "d": dry_run},
        )
        run = dict(zip(RUN_FIELDS, rows[0], strict=True)) if rows else None
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
