"""The tables people purge, on both drivers: keyed by uuid, text or a composite key, or with no key
at all (block chunks need none), and names that need quoting everywhere (schema, table, columns,
archive table, ledger schema), including names that hold ``"``, ``.``, ``;`` and spaces."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers, verify_run
from tests.core.helpers import CUTOFF, make_policy, rows, scalar

KEYS = {
    "uuid": ("id uuid PRIMARY KEY DEFAULT gen_random_uuid()", None),
    "text": ("id text PRIMARY KEY", "'k' || g"),
    "composite": ("id bigint, part integer, PRIMARY KEY (id, part)", None),
    "none": ("note text", None),
}


def shaped_table(admin: Any, schema: str, shape: str, count: int = 6_000) -> str:
    key, expr = KEYS[shape]
    table = f'"{schema}"."shaped"'
    rows(admin, f"CREATE TABLE {table} ({key}, created_at timestamptz NOT NULL, status text NOT NULL)")
    columns = {"uuid": "", "text": "id, ", "composite": "id, part, ", "none": "note, "}[shape]
    values = {"uuid": "", "text": f"{expr}, ", "composite": "g, mod(g, 3), ", "none": "'n' || g, "}[shape]
    rows(
        admin,
        f"INSERT INTO {table} ({columns}created_at, status) SELECT {values}"
        " %(c)s::timestamptz + (mod(g * 37, 100) - 60) * interval '1 hour',"
        " CASE WHEN mod(g, 7) = 0 THEN 'open' ELSE 'closed' END FROM generate_series(1, %(n)s::integer) g",
        {"c": CUTOFF, "n": count},
    )
    rows(admin, f"ANALYZE {table}")
    return table


def eligible(admin: Any, table: str, ts: str = "created_at", status: str = "status") -> int:
    return scalar(
        admin,
        f"SELECT count(*) FROM {table} WHERE {ts} < %(c)s AND {status} <> 'open'",
        {"c": CUTOFF},
    )


def purge_all(conn: Any, policy: RetentionPolicy) -> int:
    plan = plan_run(conn, policy, CUTOFF)
    deleted = sum(run_chunk(conn, policy, plan.cutoff, c).rows_deleted for c in plan.chunks)
    assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok
    return deleted


@pytest.mark.parametrize("shape", ["uuid", "text", "composite", "none"])
def test_block_chunks_purge_tables_of_any_key_or_none(schema: str, conn: Any, admin: Any, shape: str) -> None:
    table = shaped_table(admin, schema, shape)
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    expected = eligible(admin, table)
    key = {"uuid": "id", "text": "id", "composite": None, "none": None}[shape]
    policy = make_policy(
        schema, table=f"{schema}.shaped", key_column=key, chunk_by=None, batch_size=1_000, chunk_rows=2_000
    )
    assert policy.chunk_by == "block"
    assert purge_all(conn, policy) == expected
    assert eligible(admin, table) == 0
    assert scalar(admin, f"SELECT count(*) FROM {table}") == total - expected
    assert measure_leftovers(conn, policy, CUTOFF).count == 0


@pytest.mark.parametrize("shape", ["uuid", "text"])
def test_key_chunks_on_a_non_integer_key_point_to_block_chunks(schema: str, conn: Any, admin: Any, shape: str) -> None:
    table = shaped_table(admin, schema, shape, count=100)
    policy = make_policy(schema, table=f"{schema}.shaped", chunk_by="key")
    with pytest.raises(PermanentError, match=rf"column id is {shape}.*use chunk_by 'block', which needs no key"):
        plan_run(conn, policy, CUTOFF)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == 100


# Every name holds something that would break unquoted SQL: a space, a dot, a quote, a semicolon.
ODD = {
    "schema": 'Tenant Data. "x"; drop',
    "table": 'or"der; --',
    "key": "Order Id",
    "ts": "Created At",
    "status": 'st;a"tus',
    "ledger": 'led"ger; drop schema public',
    "archive": "arch ive.old",
}


@pytest.fixture
def odd_schema(admin: Any) -> Iterator[str]:
    name = f"{ODD['schema']} {uuid.uuid4().hex[:6]}"
    ledger = f"{ODD['ledger']} {name[-6:]}"
    rows(admin, f"CREATE SCHEMA {quote_ident(name)}")
    yield name
    rows(admin, f"DROP SCHEMA IF EXISTS {quote_ident(name)} CASCADE")
    rows(admin, f"DROP SCHEMA IF EXISTS {quote_ident(ledger)} CASCADE")


@pytest.mark.parametrize("chunk_by", ["key", "block"])
def test_names_that_need_quoting_work_everywhere(odd_schema: str, conn: Any, admin: Any, chunk_by: str) -> None:
    table = TableName(odd_schema, ODD["table"])
    archive = TableName(odd_schema, ODD["archive"])
    key, ts, status = (quote_ident(ODD[k]) for k in ("key", "ts", "status"))
    rows(admin, f"CREATE TABLE {table.sql} ({key} bigint PRIMARY KEY, {ts} timestamptz NOT NULL, {status} text)")
    rows(admin, f"CREATE TABLE {archive.sql} (LIKE {table.sql})")
    rows(
        admin,
        f"INSERT INTO {table.sql} SELECT g, %(c)s::timestamptz + (mod(g * 37, 100) - 60) * interval '1 hour',"
        " CASE WHEN mod(g, 7) = 0 THEN 'open' ELSE 'closed' END FROM generate_series(1, 3000) g",
        {"c": CUTOFF},
    )
    rows(admin, f"ANALYZE {table.sql}")
    expected = eligible(admin, table.sql, ts, status)
    # As a person writes it in YAML: the qualified names SQL-quoted, the columns as they are.
    data = {
        "name": "odd",
        "conn_id": "retention_target",
        "table": str(table),
        "key_column": ODD["key"],
        "timestamp_column": f'"{ODD["ts"]}"',
        "retention": "30 days",
        "condition": f"{status} <> 'open'",
        "chunk_by": chunk_by,
        "batch_size": 500,
        "archive_table": str(archive),
        "ledger_schema": f"{ODD['ledger']} {odd_schema[-6:]}",
    }
    policy = RetentionPolicy.from_dict(data)
    assert policy.table == table and policy.archive_table == archive and policy.timestamp_column == ODD["ts"]
    assert purge_all(conn, policy) == expected
    assert eligible(admin, table.sql, ts, status) == 0
    assert scalar(admin, f"SELECT count(*) FROM {archive.sql}") == expected
    ledger = TableName(policy.ledger_schema, "runs")
    assert scalar(admin, f"SELECT target_table FROM {ledger.sql}") == str(table)
    # The public schema and everything else are untouched.
    assert scalar(admin, "SELECT count(*) FROM pg_namespace WHERE nspname = 'public'") == 1
