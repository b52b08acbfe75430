"""Statements against the target table: quoting, parameters, and conditions with literal percent signs."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow_retention.core.engine import run_chunk
from airflow_retention.core.ledger import ChunkSpec
from airflow_retention.core.policy import RetentionPolicy
from airflow_retention.core.sql import condition_probe, eligibility


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
    from airflow_retention.core.catalog import TargetInfo

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
    assert '"tenant" = ANY(%(tenants)s::text[]::integer[])' in pred
    assert pred.endswith("(\na = 1 or b = 2\n)")
    assert condition_probe(policy) == 'EXPLAIN SELECT 1 FROM "public"."user" WHERE (\na = 1 or b = 2\n)'
