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


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_the_dead_letter_redo_adds_archived_rows_and_batches_to_the_chunk(
    schema: str, conn: Any, admin: Any, chunk_by: str
) -> None:
    table = interleaved(admin, schema, 4_000)
    archive = create_events(admin, schema, "events_archive", key_index="none", ts_index=False, tenant_index=False)
    reference_expired_rows(admin, schema, table)
    expected = sum(per_tenant_eligible(admin, table).values())
    policy = one_pass(
        schema,
        chunk_by=chunk_by,
        chunk_rows=100_000,
        batch_size=300,
        target_batch_time=0,
        archive_table=f"{schema}.events_archive",
    )
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
