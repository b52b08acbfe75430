"""A ``condition`` refers to the row being deleted by the policy table's own name (``events.id``): every
statement names its target under that alias, on a plain table and on each leaf of a partitioned one,
so that correlated subqueries bind to the row at hand."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.planning.planner import plan_run
from tests.core.helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows
from tests.core.partition_helpers import create_monthly
from tests.core.tenant_helpers import purge


def snapshot(admin: Any, table: str) -> list[tuple[int, int, Any]]:
    return [tuple(r) for r in rows(admin, f"SELECT id, tenant_id, created_at FROM {table}")]  # type: ignore[misc]


def remaining(admin: Any, table: str) -> set[int]:
    return {r[0] for r in rows(admin, f"SELECT id FROM {table}")}


def unreferenced(admin: Any, schema: str, table: str) -> set[int]:
    """Ids a "no reference to it" policy keeps, by the tests' own Python: newer than the cutoff, or named
    in refs."""
    referenced = {r[0] for r in rows(admin, f'SELECT event_id FROM "{schema}".refs')}
    return {key for key, _, created in snapshot(admin, table) if created >= CUTOFF or key in referenced}


def latest_kept(admin: Any, table: str) -> set[int]:
    """Ids a "keep the latest row of each tenant" policy keeps, by the tests' own Python: newer than the
    cutoff, or no row of its tenant newer than it."""
    found = snapshot(admin, table)
    newest: dict[int, Any] = {}
    for _, tenant, created in found:
        newest[tenant] = max(created, newest.get(tenant, created))
    return {key for key, tenant, created in found if created >= CUTOFF or created >= newest[tenant]}


def refs(admin: Any, schema: str, table: str, where: str) -> None:
    # A column named id too: an unqualified id in the condition's subquery would be the reference's own.
    rows(admin, f'CREATE TABLE "{schema}".refs (id bigint, event_id bigint)')
    rows(admin, f'INSERT INTO "{schema}".refs SELECT -id, id FROM {table} WHERE {where}')


def no_reference(schema: str) -> str:
    return f'NOT EXISTS (SELECT 1 FROM "{schema}".refs r WHERE r.event_id = events.id)'


def latest_per_tenant(schema: str) -> str:
    return (
        f'EXISTS (SELECT 1 FROM "{schema}".events newer'
        " WHERE newer.tenant_id = events.tenant_id AND newer.created_at > events.created_at)"
    )


def old_tenant(admin: Any, table: str) -> None:
    """Tenant 9: rows only before the cutoff, so its latest row is eligible by time and kept by the rule."""
    rows(
        admin,
        f"INSERT INTO {table} (id, tenant_id, created_at, status, payload)"
        " SELECT 100000 + g, 9, %(c)s::timestamptz - g * interval '1 day', 'closed', 'x'"
        " FROM generate_series(1, 40) g",
        {"c": CUTOFF},
    )


@pytest.mark.parametrize("chunk_by", ["key", "block"])
@pytest.mark.parametrize("rule", ["no_reference", "latest_per_tenant"])
def test_a_correlated_condition_on_a_plain_table(schema: str, conn: Any, admin: Any, chunk_by: str, rule: str) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 3_000, tenant="1 + mod(g, 4)")
    old_tenant(admin, table)
    refs(admin, schema, table, "mod(id, 5) = 0")
    condition = no_reference(schema) if rule == "no_reference" else latest_per_tenant(schema)
    expected = unreferenced(admin, schema, table) if rule == "no_reference" else latest_kept(admin, table)
    before = remaining(admin, table)
    assert 0 < len(expected) < len(before)
    policy = make_policy(schema, chunk_by=chunk_by, condition=condition, chunk_rows=700, batch_size=150)
    plan = purge(conn, policy)
    assert remaining(admin, table) == expected
    deleted = sum(c["rows_deleted"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key))
    assert deleted == len(before) - len(expected)


@pytest.mark.parametrize("action", ["delete", "drop"])
@pytest.mark.parametrize("rule", ["no_reference", "latest_per_tenant"])
def test_a_correlated_condition_on_a_partitioned_table(
    schema: str, conn: Any, admin: Any, rule: str, action: str
) -> None:
    """Block chunks per leaf run on the leaf (``"m03" AS "events"``): ``events.id`` failed there with
    "missing FROM-clause entry for table events". With ``drop``, a month with a kept row is purged row by
    row instead, and the others are dropped whole."""
    table = create_monthly(admin, schema, rows_per_month=600)
    if rule == "no_reference":
        refs(admin, schema, table, "created_at >= '2024-02-01' AND created_at < '2024-03-01' AND mod(id, 5) = 0")
        expected, condition = unreferenced(admin, schema, table), no_reference(schema)
    else:
        expected, condition = latest_kept(admin, table), latest_per_tenant(schema)
    before = remaining(admin, table)
    assert 0 < len(expected) < len(before)
    policy = make_policy(
        schema,
        chunk_by="block",
        key_column=None,
        condition=condition,
        expired_partitions=action,
        batch_size=200,
        chunk_rows=500,
    )
    plan = purge(conn, policy)
    leaves = {c.partition for c in plan.chunks if c.action is None}
    assert len(leaves) > (1 if action == "delete" else 0) and None not in leaves  # block chunks on leaves
    if action == "drop":
        assert "drop" in {c.action for c in plan.chunks}
    assert remaining(admin, table) == expected


def test_a_condition_that_does_not_parse_names_the_field(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema, rows_per_month=100)
    before = remaining(admin, table)
    for condition in ("events.nope > 0", "NOT EXISTS (SELECT 1 FROM nowhere n WHERE n.id = events.id)", "id >"):
        policy = make_policy(schema, chunk_by="block", key_column=None, condition=condition)
        with pytest.raises(PermanentError, match=r"policy 'events_purge': field 'condition' is not valid SQL"):
            plan_run(conn, policy, CUTOFF)
    assert remaining(admin, table) == before


@pytest.mark.parametrize("shape", ["plain_block", "plain_key", "partitioned"])
def test_the_alias_with_an_archive_and_tenants_in_one_pass(schema: str, conn: Any, admin: Any, shape: str) -> None:
    """The aliased target in the archive's CTE (``DELETE … AS "events" … RETURNING``, then ``INSERT``) and in
    the one-pass tenant statements: the archive holds exactly the rows deleted, whole."""
    if shape == "partitioned":
        table = create_monthly(admin, schema, rows_per_month=400)
        overrides: dict[str, Any] = {"chunk_by": "block", "key_column": None}
    else:
        table = create_events(admin, schema)
        fill_events(admin, table, 2_000, tenant="1 + mod(g, 4)")
        old_tenant(admin, table)
        overrides = {"chunk_by": shape.removeprefix("plain_")}
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    expected = latest_kept(admin, table)
    whole = {r[0]: r for r in rows(admin, f"SELECT * FROM {table}")}
    policy = make_policy(
        schema,
        condition=latest_per_tenant(schema),
        tenant_column="tenant_id",
        archive_table=f"{schema}.archive",
        chunk_rows=600,
        batch_size=150,
        **overrides,
    )
    purge(conn, policy)
    assert remaining(admin, table) == expected
    archived = rows(admin, f'SELECT * FROM "{schema}".archive')
    assert sorted(archived) == sorted(r for key, r in whole.items() if key not in expected)
