"""The marketplace seed's test plan (shared/seeds/001), on one-pass tenant chunks and both drivers:
the same job twice leaves one audit record per tenant and interval; a worker killed before its commit
leaves nothing, one killed after it (the commit done, the acknowledgement lost) is redelivered
harmlessly, also while the first delivery is still acknowledging; two jobs over overlapping intervals
delete each row once and count it once; malformed rows reach a dead letter with their context (tenant,
cutoff, interval, failure class, message, attempts) while the other tenants are purged.

The audit record of a tenant and interval is its row in the ledger's ``tenant_counts`` (run, chunk,
tenant): written in the same transaction as the batch's ``DELETE``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import verify_run
from tests.conftest import connect
from tests.core.helpers import CUTOFF, ledger_chunk, rows, scalar, wait_for
from tests.core.tenant_helpers import (
    WORKER_APPLICATION,
    interleaved,
    ledger_tenant_counts,
    one_pass,
    per_tenant_eligible,
    start_worker,
)


def audit_records(admin: Any, ledger: str, run_key: str) -> list[tuple[Any, ...]]:
    return rows(
        admin,
        f'SELECT chunk_key, tenant, rows_deleted, batches FROM "{ledger}".tenant_counts WHERE run_key = %(k)s'
        " ORDER BY 1, 2",
        {"k": run_key},
    )


def blocks_of(admin: Any, table: str) -> int:
    return int(scalar(admin, f"SELECT pg_relation_size('{table}'::regclass) / current_setting('block_size')::int"))


def test_the_same_job_twice_leaves_one_audit_record_per_tenant_and_interval(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema)
    plan = plan_run(conn, policy, CUTOFF)
    assert len(plan.chunks) > 1
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    first = audit_records(admin, policy.ledger_schema, plan.run_key)
    assert {t for _, t, _, _ in first} == set(expected)
    # One record per chunk and tenant, however many batches the chunk took.
    assert len({(c, t) for c, t, _, _ in first}) == len(first)
    # The trigger fires again for the same date: the same run, the same chunks, nothing more recorded.
    again = plan_run(conn, policy, CUTOFF)
    assert again.run_key == plan.run_key and [c.key for c in again.chunks] == [c.key for c in plan.chunks]
    for chunk in again.chunks:
        result = run_chunk(conn, policy, again.cutoff, chunk)
        assert result.already_complete and result.rows_deleted == 0
    assert audit_records(admin, policy.ledger_schema, plan.run_key) == first
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    assert per_tenant_eligible(admin, table) == {}


def test_a_worker_killed_before_its_commit_leaves_nothing(
    schema: str, conn: Any, admin: Any, driver: str, dsn: str, tmp_path: Path
) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, chunk_rows=100_000, target_batch_time=0, batch_size=300, lock_timeout="60 seconds")
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    # Hold one eligible row of the first batch's blocks: the worker's DELETE waits for it, uncommitted.
    holder = connect("psycopg2", dsn)
    try:
        with holder.cursor() as cur:
            cur.execute(
                f"SELECT id FROM {table} WHERE ctid < '(1,0)'::tid AND status <> 'open' AND created_at < %(c)s"
                " LIMIT 1 FOR UPDATE",
                {"c": CUTOFF},
            )
            assert cur.fetchone() is not None
        with (tmp_path / "child.err").open("w") as stderr:
            child = start_worker(driver, dsn, policy, chunk, stderr)
        try:
            wait_for(lambda: worker_backends(admin) == 1, 60, "the worker's DELETE waiting for the held row")
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
    finally:
        holder.rollback()  # the orphaned backend now runs its DELETE, finds its client gone, rolls back
        holder.close()
    wait_for(lambda: worker_backends(admin, waiting=False) == 0, 60, "the orphaned backend to end")
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert row["batches"] == 0 and row["rows_deleted"] == 0
    assert audit_records(admin, policy.ledger_schema, plan.run_key) == []
    assert per_tenant_eligible(admin, table) == expected  # not one row gone
    result = run_chunk(conn, policy, plan.cutoff, chunk)  # the redelivery
    assert result.rows_deleted == sum(expected.values())
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected


def test_a_worker_killed_after_its_commit_is_redelivered_harmlessly(
    schema: str, conn: Any, admin: Any, driver: str, dsn: str, tmp_path: Path
) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, chunk_rows=100_000, target_batch_time=0, batch_size=300)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    with (tmp_path / "child.err").open("w") as stderr:
        child = start_worker(driver, dsn, policy, chunk, stderr, die_after_commit=True)
        assert child.wait(timeout=60) == -signal.SIGKILL
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert row["state"] == "running" and row["batches"] == 1
    committed = ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)
    gone = {t: n - per_tenant_eligible(admin, table).get(t, 0) for t, n in expected.items()}
    assert committed == {t: n for t, n in gone.items() if n} and sum(committed.values()) == row["rows_deleted"] > 0
    result = run_chunk(conn, policy, plan.cutoff, chunk)  # the redelivery resumes after the committed batch
    assert result.resumed_from is not None and result.rows_deleted == sum(expected.values()) - row["rows_deleted"]
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    assert per_tenant_eligible(admin, table) == {}


def test_a_redelivery_while_the_first_delivery_acknowledges_changes_nothing(
    schema: str, conn: Any, admin: Any, driver: str, dsn: str, tmp_path: Path
) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    # One batch does the whole chunk; the worker then takes 30 s to "acknowledge" (its on_batch pause).
    policy = one_pass(schema, chunk_rows=100_000, target_batch_time=0, batch_size=100_000)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    with (tmp_path / "child.err").open("w") as stderr:
        child = start_worker(driver, dsn, policy, chunk, stderr, pause=30)
        try:
            wait_for(
                lambda: ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["state"] == "complete",
                60,
                "the first delivery's commit",
            )
            assert child.poll() is None  # still acknowledging
            records = audit_records(admin, policy.ledger_schema, plan.run_key)
            result = run_chunk(conn, policy, plan.cutoff, chunk)
            assert result.already_complete and result.rows_deleted == 0
            assert audit_records(admin, policy.ledger_schema, plan.run_key) == records
            assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
        finally:
            child.kill()
            child.wait(timeout=10)


def test_two_jobs_over_overlapping_intervals_delete_and_count_each_row_once(
    schema: str, admin: Any, driver: str, dsn: str, tmp_path: Path
) -> None:
    table = interleaved(admin, schema, count=40_000)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, target_batch_time=0, batch_size=400)
    end = blocks_of(admin, table)
    # Two jobs from the same first block, one over the whole table and one over three quarters of it:
    # they race for the same rows batch after batch.
    jobs = [ChunkSpec(key=f"blocks:0-{hi - 1}", lo=0, hi=hi) for hi in (end, end * 3 // 4)]
    children = []
    for n, job in enumerate(jobs):
        with (tmp_path / f"child{n}.err").open("w") as stderr:
            children.append(start_worker(driver, dsn, policy, job, stderr, lone=True, pause=0))
    try:
        for child in children:
            assert child.wait(timeout=120) == 0, (tmp_path / "child0.err").read_text()[-2000:]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert per_tenant_eligible(admin, table) == {}
    run_key = scalar(admin, f'SELECT run_key FROM "{policy.ledger_schema}".runs')
    counted = ledger_tenant_counts(admin, policy.ledger_schema, run_key)
    assert counted == expected  # both jobs together: each row counted once, by whichever deleted it
    per_job = rows(
        admin,
        f'SELECT chunk_key, rows_deleted FROM "{policy.ledger_schema}".chunks WHERE run_key = %(k)s',
        {"k": run_key},
    )
    assert len(per_job) == 2 and sum(n for _, n in per_job) == sum(expected.values())


def test_malformed_rows_reach_a_dead_letter_with_their_context(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    # Some of tenant 5's expired rows are malformed: a trigger refuses to delete them.
    rows(
        admin,
        f'CREATE FUNCTION "{schema}".refuse_malformed() RETURNS trigger LANGUAGE plpgsql AS $$'
        " BEGIN IF OLD.payload LIKE 'malformed%%' THEN"
        " RAISE EXCEPTION 'malformed payload in event %%', OLD.id; END IF; RETURN OLD; END $$",
    )
    rows(
        admin,
        f"CREATE TRIGGER refuse_malformed BEFORE DELETE ON {table} FOR EACH ROW"
        f' EXECUTE FUNCTION "{schema}".refuse_malformed()',
    )
    rows(
        admin,
        f"UPDATE {table} SET payload = 'malformed: ' || payload WHERE id IN (SELECT id FROM {table}"
        " WHERE tenant_id = 5 AND status <> 'open' AND created_at < %(c)s ORDER BY id LIMIT 3)",
        {"c": CUTOFF},
    )
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, chunk_rows=100_000, batch_size=400, target_batch_time=0)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    for attempt in (1, 2):  # the first delivery, then a retry before anyone fixed the data
        with pytest.raises(PermanentError, match=r"tenant 5: raised by a trigger"):
            run_chunk(conn, policy, plan.cutoff, chunk)
        letter = rows(
            admin,
            f"SELECT tenant, cutoff, chunk_key, lo, hi, failure_class, sqlstate, message, attempts, resolved_at"
            f' FROM "{policy.ledger_schema}".dead_letters',
        )
        assert letter == [
            ("5", CUTOFF, chunk.key, chunk.lo, chunk.hi, "raised by a trigger", "P0001", letter[0][7], attempt, None)
        ]
        assert "malformed payload in event" in letter[0][7]
    left = per_tenant_eligible(admin, table)
    assert set(left) == {"5"}  # every other tenant purged, and counted
    counts = ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)
    assert {t: n for t, n in counts.items() if t != "5"} == {t: n for t, n in expected.items() if t != "5"}
    verification = verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks])
    assert not verification.ok and "tenant 5 left: raised by a trigger" in verification.describe()


def worker_backends(admin: Any, *, waiting: bool = True) -> int:
    """Backends of the drill's worker processes: waiting for a lock, or at all."""
    lock = " AND wait_event_type = 'Lock'" if waiting else ""
    return int(
        scalar(
            admin,
            f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{WORKER_APPLICATION}'"
            f" AND datname = current_database(){lock}",
        )
    )
