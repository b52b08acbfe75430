"""Fault drills against the real PostgreSQL, on both drivers: a killed session, foreground traffic during
a purge, two runs of one policy racing, and the purge running with least privilege. Each asserts on the
table and the ledger: nothing lost, nothing deleted twice, nothing deleted that should stay."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import Plan, plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from tests.conftest import DSN, connect
from tests.core.helpers import (
    CUTOFF,
    create_events,
    eligible_ids,
    expected_batches,
    fill_events,
    make_policy,
    rows,
    scalar,
    start_and_join,
)


def purge_with_retries(
    driver: str, policy: RetentionPolicy, plan: Plan, chunk: ChunkSpec, dsn: str = DSN, errors: list[str] | None = None
) -> int:
    """What Airflow does with a chunk task: run it, and on a retryable error run it again (new session).
    The SQLSTATEs of the retried errors are appended to ``errors``."""
    for _attempt in range(5):
        conn = connect(driver, dsn)
        try:
            return run_chunk(conn, policy, plan.cutoff, chunk).rows_deleted
        except RetryableError as exc:
            if errors is not None:
                errors.append(exc.sqlstate or "connection")
            continue
        finally:
            conn.close()
    raise AssertionError(f"chunk {chunk.key} still failing after 5 attempts")


def test_session_terminated_mid_batch_applies_nothing_and_the_retry_completes(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 5_000)
    eligible = eligible_ids(admin, table)
    policy = make_policy(schema, batch_size=500, lock_timeout="30s")
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    first, second, third = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)[:3]
    done = len(first.eligible) + len(second.eligible)
    assert done > 0 and len(third.eligible) > 10
    blocker = connect("psycopg2")
    with blocker.cursor() as cur:  # the third batch will wait on this row's lock
        cur.execute(f"SELECT id FROM {table} WHERE id = %s FOR UPDATE", (third.eligible[10],))
    failure: list[BaseException] = []
    worker = connect(driver)

    def purge() -> None:
        try:
            run_chunk(worker, policy, plan.cutoff, chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failure.append(exc)

    thread = threading.Thread(target=purge)
    thread.start()
    waiting = (
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        " AND query LIKE '%%DELETE FROM%%'"
    )
    deadline = time.monotonic() + 20
    while not rows(admin, waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid,) = rows(admin, waiting)[0]
    ledger = Ledger(policy.ledger_schema)
    before = {c["chunk_key"]: c for c in ledger.chunk_rows(admin, plan.run_key)}[chunk.key]
    gone_before = len(eligible) - len(eligible_ids(admin, table))
    assert scalar(admin, "SELECT pg_terminate_backend(%(p)s)", {"p": pid})
    thread.join(20)
    blocker.rollback()
    blocker.close()
    worker.close()

    assert len(failure) == 1 and isinstance(failure[0], RetryableError), failure
    # The killed batch left nothing: the rows it was deleting are back, the ledger did not move.
    assert len(eligible) - len(eligible_ids(admin, table)) == gone_before == before["rows_deleted"] == done
    assert eligible_ids(admin, table) == [i for i in eligible if i >= second.hi]
    assert (before["next_key"], before["batches"]) == (second.hi, 2)
    assert purge_with_retries(driver, policy, plan, chunk) == len(eligible) - done
    after = {c["chunk_key"]: c for c in ledger.chunk_rows(admin, plan.run_key)}[chunk.key]
    assert (after["state"], after["rows_deleted"], after["attempts"]) == ("complete", len(eligible), 2)
    assert eligible_ids(admin, table) == []


@pytest.mark.solo
def test_foreground_inserts_and_updates_keep_working_during_a_purge(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 40_000)
    eligible = eligible_ids(admin, table)
    live = sorted(set(range(1, 40_001)) - set(eligible))[:2000]
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    policy = make_policy(schema, batch_size=1_000, chunk_rows=10_000, lock_timeout="500ms")
    plan = plan_run(conn, policy, CUTOFF)
    latencies: list[float] = []
    finished_at: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def foreground() -> None:
        fg = connect("psycopg2")
        fg.autocommit = True
        i = 0
        try:
            with fg.cursor() as cur:
                cur.execute("SET lock_timeout = '500ms'")
                while not done.is_set() or i < 200:
                    started = time.perf_counter()
                    cur.execute(
                        f"INSERT INTO {table} (id, tenant_id, created_at, status, payload)"
                        " VALUES (%s, 1, now(), 'open', 'new')",
                        (1_000_000 + i,),
                    )
                    cur.execute(f"UPDATE {table} SET payload = 'touched' WHERE id = %s", (live[i % len(live)],))
                    latencies.append(time.perf_counter() - started)
                    finished_at.append(time.perf_counter())
                    i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            fg.close()

    thread = threading.Thread(target=foreground)
    thread.start()
    purge_started = time.perf_counter()
    try:
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
    finally:
        purge_ended = time.perf_counter()
        done.set()
        thread.join(60)
    assert errors == []
    assert sum(purge_started <= t <= purge_ended for t in finished_at) >= 20  # the traffic overlapped the purge
    inserted = len(latencies)
    assert inserted >= 200
    assert max(latencies) < 0.5  # nothing waited as long as lock_timeout
    assert eligible_ids(admin, table) == []
    assert scalar(admin, f"SELECT count(*) FROM {table}") == total - len(eligible) + inserted
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE payload = 'touched'") == min(inserted, len(live))


def test_two_runs_of_one_policy_racing_delete_each_row_once(schema: str, conn: Any, admin: Any, driver: str) -> None:
    from datetime import timedelta

    table = create_events(admin, schema)
    fill_events(admin, table, 30_000, tenant="1 + mod(g, 3)")
    policy = make_policy(schema, tenant_column="tenant_id", batch_size=500, chunk_rows=2_000)
    earlier, later = CUTOFF - timedelta(hours=20), CUTOFF
    expected = eligible_ids(admin, table, later)
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    plans = [plan_run(conn, policy, earlier), plan_run(conn, policy, later)]
    # Four workers take the chunks of both runs at once, the older run's chunks overlapping the newer's.
    work = [
        (plan, chunk)
        for pair in zip(plans[0].chunks, plans[1].chunks, strict=False)
        for plan, chunk in zip(plans, pair, strict=True)
    ]
    work += [(plans[1], c) for c in plans[1].chunks[len(plans[0].chunks) :]]
    deleted: list[int] = []
    retried: list[str] = []
    lock = threading.Lock()

    def worker(items: list[tuple[Plan, ChunkSpec]]) -> None:
        for plan, chunk in items:
            n = purge_with_retries(driver, policy, plan, chunk, errors=retried)
            with lock:
                deleted.append(n)

    threads = [threading.Thread(target=worker, args=(work[i::4],)) for i in range(4)]
    start_and_join(threads, 120)
    assert eligible_ids(admin, table, later) == []
    assert scalar(admin, f"SELECT count(*) FROM {table}") == total - len(expected)
    ledger = Ledger(policy.ledger_schema)
    ledger_total = sum(c["rows_deleted"] for p in plans for c in ledger.chunk_rows(admin, p.run_key))
    assert ledger_total == sum(deleted) == len(expected)  # every row counted by exactly one run
    assert all(c["state"] == "complete" for p in plans for c in ledger.chunk_rows(admin, p.run_key))
    assert retried == []  # no deadlock (40P01), no lock timeout between the two runs' transactions


def test_the_purge_runs_with_least_privilege(schema: str, admin: Any, driver: str, purger: str) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 3_000)
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    eligible = eligible_ids(admin, table)
    # The grants of docs/deployment.md, and nothing else.
    rows(admin, f'CREATE SCHEMA "{schema}_ledger" AUTHORIZATION "{purger}"')
    rows(admin, f'GRANT USAGE ON SCHEMA "{schema}" TO "{purger}"')
    rows(admin, f'GRANT SELECT, DELETE ON {table} TO "{purger}"')
    rows(admin, f'GRANT INSERT ON "{schema}".archive TO "{purger}"')
    dsn = make_dsn(DSN, user=purger, password=None)
    policy = make_policy(schema, archive_table=f"{schema}.archive", batch_size=500)
    conn = connect(driver, dsn)
    try:
        plan = plan_run(conn, policy, CUTOFF)
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
    finally:
        conn.close()
    assert eligible_ids(admin, table) == []
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".archive') == len(eligible)
    # Without DELETE the purge fails permanently, naming the privilege, and deletes nothing.
    # A chunk planned before the grant was revoked fails at once too.
    fill_events(admin, table, 1_000, first_id=100_000)
    later = plan.cutoff.replace(minute=1)
    conn = connect(driver, dsn)
    try:
        (chunk, *_) = plan_run(conn, policy, later).chunks
        rows(admin, f'REVOKE DELETE ON {table} FROM "{purger}"')
        left = eligible_ids(admin, table)
        lacks = f"insufficient privilege: role {purger} lacks DELETE on {schema}.events"
        with pytest.raises(PermanentError, match=lacks):
            run_chunk(conn, policy, later, chunk)
        with pytest.raises(PermanentError, match=lacks):
            plan_run(conn, policy, later.replace(minute=2))
    finally:
        conn.close()
    assert eligible_ids(admin, table) == left


def test_a_ledger_the_role_cannot_write_fails_clearly_and_deletes_nothing(
    schema: str, admin: Any, driver: str, purger: str
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 1_000)
    eligible = eligible_ids(admin, table)
    policy = make_policy(schema)
    admin_conn = connect(driver)
    try:
        Ledger(policy.ledger_schema).ensure(admin_conn)  # created by the administrator, not granted
    finally:
        admin_conn.close()
    rows(admin, f'GRANT USAGE ON SCHEMA "{schema}" TO "{purger}"')
    rows(admin, f'GRANT SELECT, DELETE ON {table} TO "{purger}"')
    conn = connect(driver, make_dsn(DSN, user=purger, password=None))
    try:
        with pytest.raises(PermanentError, match=r"insufficient privilege|permission denied"):
            plan_run(conn, policy, CUTOFF)
    finally:
        conn.close()
    assert eligible_ids(admin, table) == eligible


def test_rows_with_a_null_timestamp_are_never_deleted_and_reported(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table = create_events(admin, schema)
    rows(admin, f"ALTER TABLE {table} ALTER COLUMN created_at DROP NOT NULL")
    fill_events(admin, table, 2_000)
    rows(admin, f"UPDATE {table} SET created_at = NULL WHERE mod(id, 100) = 0")
    eligible = eligible_ids(admin, table)
    policy = make_policy(schema)
    with caplog.at_level("WARNING", logger="airflow_retention"):
        plan = plan_run(conn, policy, CUTOFF)
    assert "20 row(s) of" in caplog.text and "NULL created_at: they are never deleted" in caplog.text
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert eligible_ids(admin, table) == []
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at IS NULL") == 20
    assert len(eligible) > 0


def test_server_restarted_between_batches_then_the_retry_completes(driver: str) -> None:
    from airflow_retention.demo.postgres import admin_execute, restart_server

    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin_execute(DSN, f'CREATE SCHEMA "{schema}"')
    try:
        admin = connect("psycopg2")
        admin.autocommit = True
        table = create_events(admin, schema)
        fill_events(admin, table, 3_000)
        eligible = eligible_ids(admin, table)
        policy = make_policy(schema, batch_size=400)
        conn = connect(driver)
        (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
        planned = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)
        done = len(planned[0].eligible) + len(planned[1].eligible)
        assert len(planned) > 3 and done > 0
        admin.close()
        batches: list[int] = []

        def restart_after_two(report: Any) -> None:
            batches.append(report.deleted)
            if len(batches) == 2:
                restart_server(DSN)

        with pytest.raises(RetryableError):
            run_chunk(conn, policy, plan.cutoff, chunk, on_batch=restart_after_two)
        conn.close()
        admin = connect("psycopg2")
        admin.autocommit = True
        (row,) = [c for c in Ledger(policy.ledger_schema).chunk_rows(admin, plan.run_key)]
        assert (row["state"], row["rows_deleted"], row["batches"], row["next_key"]) == (
            "running",
            done,
            2,
            planned[1].hi,
        )
        assert batches == [len(planned[0].eligible), len(planned[1].eligible)]
        assert eligible_ids(admin, table) == [i for i in eligible if i >= planned[1].hi]
        assert purge_with_retries(driver, policy, plan, chunk) == len(eligible) - done
        (row,) = [c for c in Ledger(policy.ledger_schema).chunk_rows(admin, plan.run_key)]
        assert (row["state"], row["rows_deleted"], row["attempts"]) == ("complete", len(eligible), 2)
        assert eligible_ids(admin, table) == []
        admin.close()
    finally:
        admin_execute(
            DSN, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE', f'DROP SCHEMA IF EXISTS "{schema}_ledger" CASCADE'
        )


def test_wal_compression_follows_the_roles_right_to_set_it(
    schema: str, admin: Any, driver: str, purger: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 1_000)
    rows(admin, f'CREATE SCHEMA "{schema}_ledger" AUTHORIZATION "{purger}"')
    rows(admin, f'GRANT USAGE ON SCHEMA "{schema}" TO "{purger}"')
    rows(admin, f'GRANT SELECT, DELETE ON {table} TO "{purger}"')
    eligible = eligible_ids(admin, table)
    conn = connect(driver, make_dsn(DSN, user=purger, password=None))
    try:
        # auto: the role may not set it, so the batches keep the server's setting, and the log says how to grant it.
        with caplog.at_level(logging.INFO):
            assert inspect_target(conn, make_policy(schema, wal_compression="auto")).wal_compression is None
        assert f"role {purger} may not set wal_compression" in caplog.text
        assert f'GRANT SET ON PARAMETER wal_compression TO "{purger}"' in caplog.text
        # An explicit value it cannot set fails the plan, naming the field and the grant, and deletes nothing.
        with pytest.raises(PermanentError, match=r"field 'wal_compression': role .* may not set wal_compression"):
            plan_run(conn, make_policy(schema, wal_compression="pglz"), CUTOFF)
        assert eligible_ids(admin, table) == eligible
        # Granted (PostgreSQL 15+), the same policy sets it in its batches and purges.
        rows(admin, f'GRANT SET ON PARAMETER wal_compression TO "{purger}"')
        policy = make_policy(schema, wal_compression="pglz")
        (current,) = rows(admin, "SELECT current_setting('wal_compression')")[0]
        assert inspect_target(conn, policy).wal_compression == (None if current == "pglz" else "pglz")
        plan = plan_run(conn, policy, CUTOFF)
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        assert eligible_ids(admin, table) == []
    finally:
        conn.close()
        rows(admin, f'REVOKE SET ON PARAMETER wal_compression FROM "{purger}"')
