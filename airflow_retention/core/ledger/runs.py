"""Statements on the ledger's ``runs`` table: a run registered with its plan, read back, completed with
its chunks' totals, listed, and pruned (with the policy's old failed plans); the cutoffs of a policy's
complete runs, which ``verify`` reads to find the scheduled days that were missed.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.records import RunRecord
from airflow_retention.core.ledger.schema import LedgerSchema

log = logging.getLogger(__name__)

# The columns of a run row, in the order of the dicts that every read of runs returns.
RUN_FIELDS = (
    "run_key", "policy", "target_table", "cutoff", "dry_run", "state", "chunk_rows", "batch_size",
    "chunks_expected", "rows_planned", "planned_at", "planned_by", "completed_at", "chunks_completed",
    "rows_deleted", "rows_archived", "rows_matched", "verified_by", "oldest_eligible_at", "eligible_left",
    "cleanup_lag_seconds", "lag_measured_at", "vacuumed_at", "run_date", "leaves_deferred",
)  # fmt: skip
# The columns of later versions are read through the row's JSON, NULL on a ledger not migrated yet: the
# CLI's status and the UI read a ledger without migrating it, and must not fail on an older one.
_LATER_COLUMNS = {
    "run_date": "(to_jsonb(runs) ->> 'run_date')::timestamptz",  # version 5
    "leaves_deferred": (  # version 7: a text[] back from its JSON array, NULL when the column is not there
        "CASE jsonb_typeof(to_jsonb(runs) -> 'leaves_deferred') WHEN 'array'"
        " THEN ARRAY(SELECT e FROM jsonb_array_elements_text(to_jsonb(runs) -> 'leaves_deferred')"
        " WITH ORDINALITY AS d (e, n) ORDER BY n) END"
    ),
}
RUN_COLUMNS = ", ".join(_LATER_COLUMNS.get(name, name) for name in RUN_FIELDS)


class LedgerRuns(LedgerSchema):
    """The runs of the ledger."""

    def register_run(self, cur: Any, run: RunRecord, *, complete_if_empty: bool = True) -> bool:
        """Insert the run if it is new; return whether this call created it. A planned run with no
        chunks is complete at once (nothing was eligible)."""
        empty_and_done = complete_if_empty and run.chunks_expected == 0
        cur.execute(
            f"INSERT INTO {self.s}.runs (run_key, policy, target_table, cutoff, dry_run, state, chunk_rows,"
            " batch_size, chunks_expected, rows_planned, planned_by, run_date, leaves_deferred)"
            " VALUES (%(run_key)s, %(policy)s, %(table)s, %(cutoff)s::timestamptz, %(dry_run)s::boolean,"
            " %(state)s, %(chunk_rows)s::bigint, %(batch_size)s::integer, %(chunks)s::integer,"
            " %(rows)s::bigint, %(by)s, %(run_date)s::timestamptz, %(deferred)s::text[])"
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
                "deferred": list(run.leaves_deferred) if run.leaves_deferred is not None else None,
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

    def get_run(self, conn: Any, run_key: str) -> dict[str, Any] | None:
        rows = dbapi.fetch_all(conn, f"SELECT {RUN_COLUMNS} FROM {self.s}.runs WHERE run_key = %(k)s", {"k": run_key})
        return dict(zip(RUN_FIELDS, rows[0], strict=True)) if rows else None

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
            f"SELECT {RUN_COLUMNS} FROM {self.s}.runs"
            f" WHERE run_key IN (SELECT run_key FROM {self.s}.runs WHERE %(p)s::text IS NULL OR policy = %(p)s::text"
            "   ORDER BY cutoff DESC, planned_at DESC LIMIT %(n)s::integer)"
            " ORDER BY policy, cutoff, planned_at",
            {"p": policy, "n": limit},
        )
        return [dict(zip(RUN_FIELDS, row, strict=True)) for row in rows]

    def policies(self, conn: Any) -> list[str]:
        """Every policy with a run in this ledger."""
        return [r[0] for r in dbapi.fetch_all(conn, f"SELECT DISTINCT policy FROM {self.s}.runs ORDER BY 1")]

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
