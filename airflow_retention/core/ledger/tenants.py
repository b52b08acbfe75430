"""Statements on the ledger's tables of tenants: rows per tenant per chunk (``tenant_counts``), each
run's frozen per-tenant cutoffs (``tenant_cutoffs``), and the tenants whose rows of a chunk failed for
good (``dead_letters``), with the rows a chunk deletes when it purges them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.records import ChunkSpec, DeadLetter
from airflow_retention.core.ledger.schema import LedgerSchema


class LedgerTenants(LedgerSchema):
    """The tenants of the ledger's chunks and runs."""

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

    def add_redone_rows(
        self, cur: Any, run_key: str, chunk_key: str, *, deleted: int, archived: int, matched: int
    ) -> None:
        """One batch a complete chunk ran when it purged its dead-lettered tenants again: its rows deleted,
        archived and matched (a dry run) and the batch itself, added to the chunk's counts as any batch's
        are, in the batch's transaction."""
        cur.execute(
            f"UPDATE {self.s}.chunks SET rows_deleted = rows_deleted + %(d)s::bigint,"
            " rows_archived = rows_archived + %(a)s::bigint, rows_matched = rows_matched + %(m)s::bigint,"
            " batches = batches + 1,"
            " outcome = CASE WHEN %(d)s::bigint > 0 THEN 'deleted' ELSE outcome END,"
            " last_batch_at = clock_timestamp() WHERE run_key = %(r)s AND chunk_key = %(c)s",
            {"r": run_key, "c": chunk_key, "d": deleted, "a": archived, "m": matched},
        )

    def take_back_matched(
        self, cur: Any, run_key: str, chunk_key: str, tenants: Sequence[str], *, same_tenant: str, listed: str
    ) -> int:
        """A dry run about to count dead-lettered tenants of a chunk again, from the chunk's start: what
        earlier walks counted of them comes off the chunk's and the tenants' ``rows_matched`` (a dry run
        deletes nothing, so the new walk counts those rows again). Returns the rows taken back.

        :param same_tenant: the ledger's ``tenant`` as the tenant column compares it
            (:func:`~airflow_retention.core.sql.predicate.tenant_value`): every spelling a batch counted.
        :param listed: ``%(t)s`` as an array of the tenant column's type
            (:func:`~airflow_retention.core.sql.predicate.tenant_values`)."""
        cur.execute(
            f"WITH old AS (SELECT tenant, rows_matched FROM {self.s}.tenant_counts WHERE run_key = %(r)s"
            f" AND chunk_key = %(c)s AND {same_tenant} = ANY({listed}) FOR UPDATE),"
            f" zeroed AS (UPDATE {self.s}.tenant_counts t SET rows_matched = 0 FROM old"
            " WHERE t.run_key = %(r)s AND t.chunk_key = %(c)s AND t.tenant = old.tenant),"
            " taken AS (SELECT coalesce(sum(rows_matched), 0)::bigint AS n FROM old)"
            f" UPDATE {self.s}.chunks SET rows_matched = rows_matched - taken.n FROM taken"
            " WHERE run_key = %(r)s AND chunk_key = %(c)s RETURNING taken.n",
            {"r": run_key, "c": chunk_key, "t": list(tenants)},
        )
        row = cur.fetchone()
        return int(row[0]) if row is not None else 0

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

    def tenants_at_cap(self, cur: Any, run_key: str, cap: int, same_tenant: str = "tenant") -> list[str]:
        """Tenants that have had at least ``cap`` rows deleted in the run: later batches leave them out.

        :param same_tenant: the ledger's ``tenant`` (text) as the tenant column compares it
            (:func:`~airflow_retention.core.sql.predicate.tenant_value`): the spellings of one tenant
            (``acme``, ``ACME`` of a citext column) count together; one spelling of each is returned."""
        cur.execute(
            f"SELECT min(tenant) FROM {self.s}.tenant_counts WHERE run_key = %(k)s GROUP BY {same_tenant}"
            " HAVING sum(rows_deleted) >= %(cap)s::bigint ORDER BY 1",
            {"k": run_key, "cap": cap},
        )
        return [r[0] for r in cur.fetchall()]
