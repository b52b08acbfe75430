"""Statements against the target table: quoting, parameters, and conditions with literal percent signs."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import BatchReport, run_chunk
from airflow_retention.core.sql.predicate import MAX_KEY, MIN_KEY, condition_probe, eligibility
from airflow_retention.core.sql.reads import leftover_statement
from tests.core.helpers import CUTOFF, ELIGIBLE, create_events, fill_events, make_policy, rows


def test_a_condition_with_like_percent_runs_on_both_drivers(conn: Any, admin: Any, schema: str) -> None:
    with admin.cursor() as cur:
        cur.execute(
            f'CREATE TABLE "{schema}"."Order" (id bigint PRIMARY KEY, ts timestamptz NOT NULL, url text NOT NULL);'
            f'CREATE INDEX ON "{schema}"."Order" (ts);'
            f"INSERT INTO \"{schema}\".\"Order\" SELECT i, '2026-01-01', CASE WHEN i % 2 = 0 THEN 'http://a'"
            " ELSE 'ftp://b' END FROM generate_series(1, 100) i"
        )
    policy = RetentionPolicy(
        name="pct",
        conn_id="unused",
        table=f"{schema}.Order",
        key_column="id",
        timestamp_column="ts",
        retention="1 day",
        condition="url LIKE 'http%'",
        batch_size=10,
        ledger_schema=f"{schema}_ledger",
    )
    result = run_chunk(
        conn, policy, datetime(2026, 2, 1, tzinfo=timezone.utc), ChunkSpec(key="all", lo=0, hi=1000), lone=True
    )
    assert result.rows_deleted == 50
    with admin.cursor() as cur:
        cur.execute(f'SELECT count(*), bool_and(url LIKE \'ftp%%\') FROM "{schema}"."Order"')
        assert cur.fetchone() == (50, True)


def test_identifiers_are_quoted_and_the_condition_is_parenthesised() -> None:
    from airflow_retention.core.sql.target import TargetInfo

    policy = RetentionPolicy(
        name="q",
        conn_id="c",
        table="public.user",
        key_column="Order",
        timestamp_column="select",
        tenant_column="tenant",
        retention="1 day",
        condition="a = 1 or b = 2",
    )
    target = TargetInfo(timestamp_has_tz=False, tenant_type="integer", columns=("Order", "select", "tenant"))
    pred = eligibility(policy, target, tenant_filter=True)
    assert '"Order" >= %(lo)s::bigint' in pred
    assert "\"select\" < (%(cutoff)s::timestamptz AT TIME ZONE 'UTC')" in pred
    assert '"tenant" = %(tenant)s::text::integer' in pred  # one tenant at a time: the (tenant, key) index
    assert "ANY(" not in pred
    assert pred.endswith("(\na = 1 or b = 2\n)")
    # The target under the alias of its own name, as in every statement (docs/policies.md, condition).
    assert condition_probe(policy) == 'EXPLAIN SELECT 1 FROM "public"."user" AS "user" WHERE (\na = 1 or b = 2\n)'


class Stop(Exception):
    pass


@pytest.mark.parametrize("tenant_column", [None, "tenant_id"])
def test_leftover_after_a_partial_purge(conn: Any, admin: Any, schema: str, tenant_column: str | None) -> None:
    """What a run left behind: the oldest eligible timestamp and the eligible count, capped."""
    table = create_events(admin, schema)
    fill_events(admin, table, 3000, tenant="1 + mod(g, 3)")
    rows(admin, f"UPDATE {table} SET tenant_id = NULL WHERE id IN (1, 2, 3)")  # no tenant: never eligible
    policy = make_policy(schema, tenant_column=tenant_column)
    target = inspect_target(conn, policy)
    statement = leftover_statement(policy, target)
    null_tenant = "" if tenant_column is None else " AND tenant_id IS NOT NULL"

    def leftover(cap: int) -> tuple[Any, int]:
        params = {"cutoff": CUTOFF, "lo": MIN_KEY, "hi": MAX_KEY, "cap": cap}
        with conn.cursor() as cur:
            cur.execute(statement, params)
            oldest, left = cur.fetchone()
        conn.rollback()
        return oldest, int(left)

    def expected() -> tuple[Any, int]:
        oldest, count = rows(
            admin, f"SELECT min(created_at), count(*) FROM {table} WHERE {ELIGIBLE}{null_tenant}", {"cutoff": CUTOFF}
        )[0]
        return oldest, int(count)

    full_oldest, full_count = expected()
    assert full_count > 1000
    assert leftover(10**9) == (full_oldest, full_count)
    # Part of the purge: the first chunk, stopped after two batches of another.
    plan = plan_run(conn, make_policy(schema, tenant_column=tenant_column, chunk_rows=400), CUTOFF)
    assert len(plan.chunks) >= 3
    run_chunk(conn, make_policy(schema, tenant_column=tenant_column, chunk_rows=400), CUTOFF, plan.chunks[0])
    seen: list[BatchReport] = []

    def stop_after_two(report: BatchReport) -> None:
        seen.append(report)
        if len(seen) == 2:
            raise Stop

    with pytest.raises(Stop):
        run_chunk(
            conn,
            make_policy(schema, tenant_column=tenant_column, chunk_rows=400),
            CUTOFF,
            plan.chunks[-1],
            on_batch=stop_after_two,
        )
    oldest, count = expected()
    assert 0 < count < full_count
    assert leftover(10**9) == (oldest, count)
    assert leftover(count) == (oldest, count)
    assert leftover(7) == (oldest, 7)  # counted only up to the cap
    assert leftover(1) == (oldest, 1)
    # Nothing left: no oldest timestamp, zero rows.
    rows(admin, f"DELETE FROM {table} WHERE {ELIGIBLE}", {"cutoff": CUTOFF})
    assert leftover(100) == (None, 0)
