"""A dry run never writes to the target, by construction: every combination of tenant column, archive
table, chunk kind and partition action leaves the table and the archive exactly as they were, and its
ledger counts exactly the eligible rows; a dry-run statement that would write fails instead of writing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running import batches, detach
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.sql.batches import batch_statement, tenant_batch
from airflow_retention.core.sql.partitions import drop_statement
from tests.core.helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows, scalar
from tests.core.partition_helpers import create_monthly, relations_in

PLAIN_CONDITION = "status <> 'open'"


def checksum(admin: Any, table: str) -> tuple[int, int]:
    """Rows and a checksum of every whole row, by the tests' own SQL."""
    count, total = rows(
        admin, f"SELECT count(*), coalesce(sum(hashtextextended(ROW(t.*)::text, 0)::numeric), 0) FROM {table} t"
    )[0]
    return int(count), int(total)


def eligible(admin: Any, table: str, condition: str | None, tenant: bool) -> int:
    """The rows a real run would delete at CUTOFF, counted independently of the package's SQL."""
    where = "created_at < %(c)s" + (f" AND ({condition})" if condition else "")
    where += " AND tenant_id IS NOT NULL" if tenant else ""
    return int(scalar(admin, f"SELECT count(*) FROM {table} WHERE {where}", {"c": CUTOFF}))


def state(admin: Any, schema: str, table: str) -> tuple[Any, ...]:
    return checksum(admin, table), checksum(admin, f'"{schema}".archive'), relations_in(admin, schema)


def dry_run_and_check(conn: Any, admin: Any, schema: str, table: str, policy: Any) -> None:
    before = state(admin, schema, table)
    expected = eligible(admin, table, policy.condition, policy.tenant_column is not None)
    assert expected > 0
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.chunks
    results = [run_chunk(conn, policy, plan.cutoff, chunk) for chunk in plan.chunks]
    assert state(admin, schema, table) == before  # not a row changed, added or gone, nor a partition
    assert sum(r.rows_deleted for r in results) == 0 and sum(r.rows_archived for r in results) == 0
    chunks = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert sum(c["rows_deleted"] for c in chunks) == 0 and sum(c["rows_archived"] for c in chunks) == 0
    assert sum(c["rows_matched"] for c in chunks) == sum(r.rows_matched for r in results) == expected
    assert {c["outcome"] for c in chunks} == {"dry_run"}


@pytest.mark.parametrize("chunk_by", ["block", "key"])
@pytest.mark.parametrize("archive", [False, True], ids=["no_archive", "archive"])
@pytest.mark.parametrize("tenant", [False, True], ids=["no_tenant", "tenant"])
def test_a_dry_run_on_a_plain_table_changes_nothing(
    schema: str, conn: Any, admin: Any, chunk_by: str, archive: bool, tenant: bool
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 3_000, tenant="CASE WHEN mod(g, 11) = 0 THEN NULL ELSE 1 + mod(g, 3) END")
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    policy = make_policy(
        schema,
        chunk_by=chunk_by,
        chunk_rows=700,
        tenant_column="tenant_id" if tenant else None,
        archive_table=f"{schema}.archive" if archive else None,
        dry_run=True,
    )
    dry_run_and_check(conn, admin, schema, table, policy)


# drop + archive_table is refused by the policy itself ('drop' would drop rows the archive should receive).
@pytest.mark.parametrize(
    ("action", "archive"),
    [("drop", False), ("detach", False), ("detach", True), ("delete", False), ("delete", True)],
    ids=["drop-no_archive", "detach-no_archive", "detach-archive", "delete-no_archive", "delete-archive"],
)
@pytest.mark.parametrize("tenant", [False, True], ids=["no_tenant", "tenant"])
def test_a_dry_run_on_a_partitioned_table_changes_nothing(
    schema: str, conn: Any, admin: Any, action: str, archive: bool, tenant: bool
) -> None:
    table = create_monthly(admin, schema, rows_per_month=300)
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    policy = make_policy(
        schema,
        chunk_by="block",
        key_column=None,
        condition=None,  # wholly expired months: their partitions are dropped or detached in a real run
        batch_size=200,
        chunk_rows=500,
        tenant_column="tenant_id" if tenant else None,
        archive_table=f"{schema}.archive" if archive else None,
        expired_partitions=action,
        dry_run=True,
    )
    plan = plan_run(conn, policy, CUTOFF)
    actions = {c.action for c in plan.chunks}
    assert actions == ({None} if action == "delete" else {None, action})  # the matrix covers each path
    dry_run_and_check(conn, admin, schema, table, policy)


def _writing(build: Any) -> Any:
    """``build`` (a statement builder) as a mutant that ignores dry_run: its statement deletes."""

    def mutant(policy: Any, *args: Any, **kwargs: Any) -> Any:
        return build(dataclasses.replace(policy, dry_run=False), *args, **kwargs)

    return mutant


@pytest.mark.parametrize(
    ("shape", "chunk_by", "tenant", "archive"),
    [
        ("plain", "block", False, False),
        ("plain", "block", False, True),
        ("plain", "key", False, False),
        ("plain", "key", True, True),  # a key chunk that packs tenants: one tenant per batch
        ("plain", "block", True, False),  # one pass: count, then DELETE
        ("plain", "block", True, True),  # one pass with an archive: DELETE in a CTE
        ("partitioned", "drop", False, False),
    ],
)
def test_a_dry_run_statement_that_would_write_fails_instead(
    schema: str,
    conn: Any,
    admin: Any,
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
    chunk_by: str,
    tenant: bool,
    archive: bool,
) -> None:
    """Mutation check: the statement builders made to forget ``dry_run`` (the defect of issue 21, item 10)
    give a statement that deletes; the dry run's read-only transaction refuses it, nothing is written."""
    if shape == "plain":
        table = create_events(admin, schema)
        fill_events(admin, table, 2_000, tenant="1 + mod(g, 3)")
        overrides: dict[str, Any] = {"chunk_by": chunk_by, "chunk_rows": 100_000}
    else:
        table = create_monthly(admin, schema, rows_per_month=300)
        overrides = {"chunk_by": "block", "key_column": None, "condition": None, "expired_partitions": chunk_by}
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    policy = make_policy(
        schema,
        tenant_column="tenant_id" if tenant else None,
        archive_table=f"{schema}.archive" if archive else None,
        dry_run=True,
        **overrides,
    )
    plan = plan_run(conn, policy, CUTOFF)
    before = state(admin, schema, table)
    monkeypatch.setattr(batches, "batch_statement", _writing(batch_statement))
    monkeypatch.setattr(batches, "tenant_batch", _writing(tenant_batch))

    def dropping_census(cur: Any, policy: Any, target: Any, cutoffs: Any, table: Any) -> Any:
        cur.execute(drop_statement(table))  # the partition count of a dry run, made to drop instead

    monkeypatch.setattr(detach, "census", dropping_census)
    chunk = next(c for c in plan.chunks if (c.action is not None) == (shape == "partitioned"))
    with pytest.raises(PermanentError, match=r"SQLSTATE 25006.*read-only transaction"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert state(admin, schema, table) == before
    (row,) = [c for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key) if c["chunk_key"] == chunk.key]
    assert row["state"] != "complete" and row["rows_deleted"] == 0 and row["rows_matched"] == 0


def test_read_only_parts_of_a_transaction(schema: str, conn: Any, admin: Any) -> None:
    """The guard itself: a read-only part of a transaction refuses writes and keeps the rows of its last
    statement readable; the transaction writes again after it; a READ ONLY transaction refuses any write."""
    table = create_events(admin, schema)
    fill_events(admin, table, 10)
    with dbapi.transaction(conn) as cur:
        cur.execute(f"INSERT INTO {table} SELECT id + 100, tenant_id, created_at, status, payload FROM {table}")
        with dbapi.read_only(cur):
            cur.execute(f"SELECT count(*) FROM {table}")
        assert cur.fetchone() == (20,)  # read after the savepoint is gone
        cur.execute(f"DELETE FROM {table} WHERE id > 100")  # read-write again
    assert scalar(admin, f"SELECT count(*) FROM {table}") == 10
    with pytest.raises(PermanentError, match=r"SQLSTATE 25006"):
        with dbapi.transaction(conn) as cur:
            with dbapi.read_only(cur):
                cur.execute(f"DELETE FROM {table}")
    with pytest.raises(PermanentError, match=r"SQLSTATE 25006"):
        with dbapi.transaction(conn, read_only=True) as cur:
            cur.execute(f"SELECT count(*) FROM {table}")
            cur.execute(f"DELETE FROM {table}")
    with dbapi.transaction(conn, repeatable_read=True, read_only=True) as cur:
        cur.execute("SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')")
        assert cur.fetchone() == ("repeatable read", "on")
    assert scalar(admin, f"SELECT count(*) FROM {table}") == 10
