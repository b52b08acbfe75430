"""Two runs of one policy purging one table at once, on both drivers: what a backfill beside the nightly
run does (``max_active_runs=1`` does not count backfill runs; docs/concepts.md, "Two runs of one policy
at once"). Each row is deleted once, archived once and counted once, in the ledger of the run that
deleted it; the runs' counts add up to the rows gone, per chunk and per tenant; nothing else is touched."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from airflow_retention.core.errors import RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import Plan, plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from tests.conftest import connect
from tests.core.helpers import CUTOFF, create_events, eligible_ids, fill_events, make_policy, rows, start_and_join


def _purge(driver: str, policy: RetentionPolicy, plan: Plan, chunk: ChunkSpec, errors: list[str]) -> None:
    """A chunk task with Airflow's retries: a retryable error (a lock wait past lock_timeout behind the
    other run's batch) runs it again in a new session."""
    for _attempt in range(10):
        conn = connect(driver)
        try:
            run_chunk(conn, policy, plan.cutoff, chunk)
            return
        except RetryableError as exc:
            errors.append(exc.sqlstate or "connection")
        finally:
            conn.close()
    raise AssertionError(f"chunk {chunk.key} of {plan.run_key} still failing after 10 attempts")


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_two_runs_of_one_policy_at_once_delete_and_count_each_row_once(
    schema: str, conn: Any, admin: Any, driver: str, chunk_by: str
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 20_000, tenant="1 + mod(g, 4)")
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    policy = make_policy(
        schema,
        chunk_by=chunk_by,
        tenant_column="tenant_id",
        archive_table=f"{schema}.archive",
        batch_size=400,
        chunk_rows=2_000,
        lock_timeout="2s",
    )
    # The nightly run and a backfilled earlier day: the earlier cutoff's rows are a subset of the later's.
    earlier, later = CUTOFF - timedelta(hours=20), CUTOFF
    expected = set(eligible_ids(admin, table, later))
    eligible_earlier = set(eligible_ids(admin, table, earlier))
    assert eligible_earlier and len(eligible_earlier) < len(expected)
    before = {r[0]: r[1:] for r in rows(admin, f"SELECT id, tenant_id::text, created_at, status FROM {table}")}
    plans = [plan_run(conn, policy, earlier), plan_run(conn, policy, later)]
    assert plans[0].run_key != plans[1].run_key and plans[0].chunks and plans[1].chunks
    # Both runs' chunks interleaved over four workers: chunks of the two runs cover the same rows at once.
    work = [(p, p.chunks[i]) for i in range(max(len(p.chunks) for p in plans)) for p in plans if i < len(p.chunks)]
    errors: list[str] = []

    def worker(items: list[tuple[Plan, ChunkSpec]]) -> None:
        for plan, chunk in items:
            _purge(driver, policy, plan, chunk, errors)

    threads = [threading.Thread(target=worker, args=(work[i::4],)) for i in range(4)]
    start_and_join(threads, 240)
    assert not any(t.is_alive() for t in threads)
    left = {r[0] for r in rows(admin, f"SELECT id FROM {table}")}
    gone = set(before) - left
    assert gone == expected  # every eligible row at the later cutoff, and nothing else
    archived = [r[0] for r in rows(admin, f'SELECT id FROM "{schema}".archive')]
    assert sorted(archived) == sorted(gone)  # each row archived exactly once
    ledger = Ledger(policy.ledger_schema)
    chunks = [c for p in plans for c in ledger.chunk_rows(admin, p.run_key)]
    assert all(c["state"] == "complete" for c in chunks)
    assert sum(c["rows_deleted"] for c in chunks) == len(gone)  # counted once, by one of the two runs
    assert sum(c["rows_archived"] for c in chunks) == len(gone)
    per_run = [sum(c["rows_deleted"] for c in ledger.chunk_rows(admin, p.run_key)) for p in plans]
    assert all(n >= 0 for n in per_run) and sum(per_run) == len(gone)
    assert per_run[0] <= len(eligible_earlier)  # the earlier run deleted only rows its own cutoff allows
    assert per_run[1] >= len(expected - eligible_earlier)  # rows only the later cutoff allows: the later run's
    if chunk_by == "block":  # one pass: the per-tenant counts of both runs add up to the rows gone per tenant
        counted = dict(
            rows(
                admin,
                f'SELECT tenant, sum(rows_deleted)::bigint FROM "{policy.ledger_schema}".tenant_counts'
                " WHERE run_key = ANY(%(k)s) GROUP BY 1",
                {"k": [p.run_key for p in plans]},
            )
        )
        by_tenant: dict[str, int] = {}
        for i in gone:
            by_tenant[before[i][0]] = by_tenant.get(before[i][0], 0) + 1
        assert counted == by_tenant
    assert set(errors) <= {"55P03", "40001"}, errors  # lock waits and serialization failures only, retried
