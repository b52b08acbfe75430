"""Issue 32, defect 2, on both drivers: the retry that purges a chunk's dead-lettered tenants again adds
every count of its batches to the chunk (rows deleted, archived, matched, batches), as the first pass
does; the chunk, its tenant counts and the archive table agree."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CUTOFF, create_events, ledger_chunk, rows, scalar
from tests.core.tenant_helpers import interleaved, one_pass, per_tenant_eligible, reference_expired_rows


def _tenant_totals(admin: Any, ledger: str, run_key: str) -> tuple[int, int, int]:
    return rows(
        admin,
        f"SELECT coalesce(sum(rows_deleted), 0)::bigint, coalesce(sum(rows_archived), 0)::bigint,"
        f' coalesce(sum(rows_matched), 0)::bigint FROM "{ledger}".tenant_counts WHERE run_key = %(k)s',
        {"k": run_key},
    )[0]


def _one_chunk(schema: str, chunk_by: str, **overrides: Any) -> Any:
    """Every tenant in one chunk, in batches of 300 rows."""
    return one_pass(schema, chunk_by=chunk_by, chunk_rows=100_000, batch_size=300, target_batch_time=0, **overrides)


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_the_dead_letter_redo_adds_archived_rows_and_batches_to_the_chunk(
    schema: str, conn: Any, admin: Any, chunk_by: str
) -> None:
    table = interleaved(admin, schema, 4_000)
    archive = create_events(admin, schema, "events_archive", key_index="none", ts_index=False, tenant_index=False)
    reference_expired_rows(admin, schema, table)
    expected = sum(per_tenant_eligible(admin, table).values())
    policy = _one_chunk(schema, chunk_by, archive_table=f"{schema}.events_archive")
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    with pytest.raises(PermanentError, match="tenant 3"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    first = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert first["rows_deleted"] == first["rows_archived"] < expected
    rows(admin, f'DELETE FROM "{schema}".orders')
    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert result.rows_deleted > 0 and per_tenant_eligible(admin, table) == {}
    after = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    archived = scalar(admin, f"SELECT count(*) FROM {archive}")
    # Every kind of count agrees: the chunk, its tenants, the archive table and the rows gone.
    assert after["rows_deleted"] == after["rows_archived"] == archived == expected
    assert _tenant_totals(admin, policy.ledger_schema, plan.run_key) == (expected, expected, 0)
    assert after["batches"] > first["batches"]


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_a_dry_run_counts_a_dead_lettered_tenant_once(schema: str, conn: Any, admin: Any, chunk_by: str) -> None:
    """A dry run deletes nothing: the redo of a tenant that failed after some of its rows were counted
    meets those rows again, and they must not be counted twice (the differential search found it)."""
    table = interleaved(admin, schema, 4_000)
    expected = per_tenant_eligible(admin, table)
    rows(admin, f'CREATE TABLE "{schema}".held (id bigint)')
    # Raises while a batch counts its rows, not while the one-pass batch lists the tenants it holds.
    rows(
        admin,
        f'CREATE FUNCTION "{schema}".hold_ok(k bigint) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN'
        f" IF current_query() LIKE '%%count(%%' AND EXISTS (SELECT 1 FROM \"{schema}\".held h WHERE h.id = k)"
        " THEN RAISE EXCEPTION 'row %% is on hold', k; END IF; RETURN true; END $$",
    )
    policy = _one_chunk(schema, chunk_by, dry_run=True, condition=f"status <> 'open' AND \"{schema}\".hold_ok(id)")
    plan = plan_run(conn, policy, CUTOFF)
    # After the plan, tenant 3's last eligible rows fail while counted, its first ones go through: the
    # tenant fails in a later batch than its first.
    rows(
        admin,
        f'INSERT INTO "{schema}".held SELECT id FROM {table} WHERE tenant_id = 3 AND status <> %(s)s'
        " AND created_at < %(c)s ORDER BY id DESC LIMIT 5",
        {"s": "open", "c": CUTOFF},
    )
    for chunk in plan.chunks:
        try:
            run_chunk(conn, policy, plan.cutoff, chunk)
        except PermanentError as exc:
            assert "tenant 3" in str(exc)
    first = _tenant_totals(admin, policy.ledger_schema, plan.run_key)[2]
    assert 0 < first < sum(expected.values())  # tenant 3's rows were partly counted before it failed
    rows(admin, f'DELETE FROM "{schema}".held')
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    matched = rows(
        admin,
        f'SELECT tenant, sum(rows_matched)::bigint FROM "{policy.ledger_schema}".tenant_counts WHERE run_key = %(k)s'
        " GROUP BY 1 HAVING sum(rows_matched) > 0",
        {"k": plan.run_key},
    )
    assert dict(matched) == expected
    chunks = scalar(
        admin,
        f'SELECT sum(rows_matched)::bigint FROM "{policy.ledger_schema}".chunks WHERE run_key = %(k)s',
        {"k": plan.run_key},
    )
    assert chunks == sum(expected.values())
    assert per_tenant_eligible(admin, table) == expected  # a dry run: nothing deleted
