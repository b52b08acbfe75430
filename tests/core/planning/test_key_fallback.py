"""Issue 32, defect 3, on both drivers: key chunks that list no tenants (the planner's fallback past
too many tenants, a lone key chunk) count every tenant of every batch, so ``tenant_counts`` is filled
and ``max_rows_per_tenant`` holds there as on every other path."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CUTOFF, create_events, fill_events, make_policy, rows
from tests.core.tenant_helpers import ledger_tenant_counts

TENANTS = 600
CAP = 5


def _table(admin: Any, schema: str) -> str:
    """600 tenants x 20 eligible rows, the tenants interleaved key by key (tenant = key mod 600)."""
    table = create_events(admin, schema)
    fill_events(
        admin,
        table,
        TENANTS * 20,
        tenant=f"mod(g, {TENANTS})",
        created="%(cutoff)s::timestamptz - interval '1 day'",
        status="'closed'",
    )
    return table


def _deleted_per_tenant(admin: Any, table: str) -> dict[str, int]:
    left = dict(rows(admin, f"SELECT tenant_id::text, count(*) FROM {table} GROUP BY 1"))
    return {str(t): 20 - left.get(str(t), 0) for t in range(TENANTS)}


def test_the_fallback_past_too_many_tenants_counts_tenants_and_keeps_the_cap(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table = _table(admin, schema)
    # A batch of 100 keys holds at most one row of each tenant: no batch takes a tenant past the cap.
    policy = make_policy(schema, tenant_column="tenant_id", max_rows_per_tenant=CAP, batch_size=100)
    plan = plan_run(conn, policy, CUTOFF, max_chunks=1)
    assert "planning by key range across tenants instead" in caplog.text
    assert [c.tenants for c in plan.chunks] == [None]
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    deleted = _deleted_per_tenant(admin, table)
    assert deleted == {str(t): CAP for t in range(TENANTS)}
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == deleted


def test_a_lone_key_chunk_of_a_tenant_policy_counts_its_tenants(schema: str, conn: Any, admin: Any) -> None:
    table = _table(admin, schema)
    policy = make_policy(schema, tenant_column="tenant_id", batch_size=250)
    lone = ChunkSpec(key="all:1-3001", lo=1, hi=3001)
    result = run_chunk(conn, policy, CUTOFF, lone, lone=True)
    assert result.rows_deleted == 3000
    deleted = {t: n for t, n in _deleted_per_tenant(admin, table).items() if n}
    assert deleted == {str(t): 5 for t in range(TENANTS)}
    run = rows(admin, f'SELECT run_key FROM "{policy.ledger_schema}".runs')[0][0]
    assert ledger_tenant_counts(admin, policy.ledger_schema, run) == deleted
