"""The chunk engine against the real PostgreSQL, on both drivers: what it deletes, what it leaves, and
what the ledger says, under replays, kills, concurrent attempts, locks and timeouts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError, PolicyError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import BatchReport, ChunkResult, run_chunk
from airflow_retention.core.running.verify import verify_run
from tests.conftest import connect
from tests.core.helpers import (
    CUTOFF,
    ELIGIBLE,
    create_events,
    eligible_ids,
    expected_batches,
    fill_events,
    ids,
    ledger_chunk,
    ledger_chunks,
    ledger_run,
    make_policy,
    rows,
    scalar,
    start_and_join,
    wait_for,
)

REPO = Path(__file__).resolve().parents[3]
BIG = 200_000


def small_table(admin: Any, schema: str, count: int = 3000) -> str:
    """``count`` rows of the default shape (about half eligible), tenants 1..3."""
    table = create_events(admin, schema)
    fill_events(admin, table, count, tenant="1 + mod(g, 3)")
    return table


def one_chunk(conn: Any, policy: RetentionPolicy) -> ChunkSpec:
    plan = plan_run(conn, policy, CUTOFF)
    assert len(plan.chunks) == 1
    return plan.chunks[0]


def progress(admin: Any, policy: RetentionPolicy, run_key: str, chunk: ChunkSpec) -> tuple[Any, ...]:
    c = ledger_chunk(admin, policy.ledger_schema, run_key, chunk.key)
    return (c["state"], c["next_key"], c["rows_deleted"], c["batches"], c["attempts"])


# -- the whole purge ---------------------------------------------------------------------------------


def test_full_purge_of_a_large_multi_tenant_table(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    # 60 % of the rows belong to tenant 1; the rest to tenants 2..24. Every 1000th row sits exactly at
    # the cutoff, the next one 1 µs before it; every 7th row is 'open' (held back by the condition).
    fill_events(
        admin,
        table,
        BIG,
        tenant="CASE WHEN mod(g, 10) < 6 THEN 1 ELSE 2 + mod(g, 23) END",
        created="CASE WHEN mod(g, 1000) = 1 THEN %(cutoff)s::timestamptz"
        " WHEN mod(g, 1000) = 2 THEN %(cutoff)s::timestamptz - interval '1 microsecond'"
        " ELSE %(cutoff)s::timestamptz + (mod(g * 37, 100) - 60) * interval '1 hour' END",
    )
    s = f'"{schema}"'
    rows(admin, f"CREATE TABLE {s}.before AS SELECT id FROM {table}")
    rows(admin, f"CREATE TABLE {s}.expected AS SELECT id FROM {table} WHERE {ELIGIBLE}", {"cutoff": CUTOFF})
    expected = scalar(admin, f"SELECT count(*) FROM {s}.expected")
    at_cutoff = scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at = %(cutoff)s", {"cutoff": CUTOFF})
    just_before = "created_at = %(cutoff)s::timestamptz - interval '1 microsecond'"
    just_before_open = scalar(
        admin, f"SELECT count(*) FROM {table} WHERE {just_before} AND status = 'open'", {"cutoff": CUTOFF}
    )
    assert 90_000 < expected < 110_000
    assert at_cutoff > 2000  # 200 placed exactly at it, and the hour grid lands on it too
    assert (
        scalar(admin, f"SELECT count(*) FROM {table} WHERE {just_before} AND status <> 'open'", {"cutoff": CUTOFF})
        > 150
    )

    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=20_000, batch_size=2_000)
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.rows_planned == expected
    assert len(plan.chunks) >= 6
    assert any(c.tenants is not None and len(c.tenants) > 1 for c in plan.chunks)
    # Eligible rows that arrive after planning in no planned range survive this run.
    fill_events(
        admin,
        table,
        50,
        first_id=BIG + 100_001,
        tenant="1",
        created="%(cutoff)s::timestamptz - interval '9 days'",
        status="'closed'",
    )

    # Each chunk's batches, cut from the keys of its range by the tests' own SQL before anything is deleted.
    planned_batches = {
        c.key: expected_batches(admin, table, c.lo, c.hi, policy.batch_size, tenants=c.tenants) for c in plan.chunks
    }
    results: list[ChunkResult] = []
    for chunk in plan.chunks:
        results.append(run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("dag", "run", chunk.seq, 1, "host")))

    # No planned eligible row remains, and nothing else is gone.
    assert scalar(admin, f"SELECT count(*) FROM {table} JOIN {s}.expected USING (id)") == 0
    assert (
        scalar(
            admin,
            f"SELECT count(*) FROM {s}.before b WHERE NOT EXISTS (SELECT FROM {table} e WHERE e.id = b.id)"
            f" AND NOT EXISTS (SELECT FROM {s}.expected x WHERE x.id = b.id)",
        )
        == 0
    )
    assert scalar(admin, f"SELECT count(*) FROM {table}") == BIG - expected + 50
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at = %(cutoff)s", {"cutoff": CUTOFF}) == at_cutoff
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE {just_before}", {"cutoff": CUTOFF}) == just_before_open
    assert (
        scalar(
            admin, f"SELECT count(*) FROM {table} WHERE status = 'open' AND created_at < %(cutoff)s", {"cutoff": CUTOFF}
        )
        > 10_000
    )
    assert len(ids(admin, table, f"id > {BIG}")) == 50

    # The ledger agrees with the table: every chunk complete once, by try 1, with what it deleted.
    chunks = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert [c["chunk_key"] for c in chunks] == [c.key for c in plan.chunks]
    assert all(c["state"] == "complete" and c["completed_at"] is not None for c in chunks)
    assert {(c["attempts"], c["completed_try_number"], c["outcome"]) for c in chunks} == {(1, 1, "deleted")}
    assert [c["rows_deleted"] for c in chunks] == [c.rows_planned for c in plan.chunks]
    assert [c["rows_deleted"] for c in chunks] == [r.rows_deleted for r in results]
    assert sum(c["rows_deleted"] for c in chunks) == expected
    assert all(c["batches"] == r.batches for c, r in zip(chunks, results, strict=True))
    for chunk, result in zip(plan.chunks, results, strict=True):  # bounded batches: 2000 keys each
        batches = planned_batches[chunk.key]
        for tenant in chunk.tenants or (None,):  # every batch of a tenant full but its last
            sizes = [len(b.keys) for b in batches if b.tenant == tenant]
            assert set(sizes[:-1]) <= {2000} and sizes[-1] <= 2000
        assert [(b.tenant, b.lo, b.hi, b.size, b.deleted) for b in result.batch_log] == [
            (b.tenant, b.lo, b.hi, 2000, len(b.eligible)) for b in batches
        ]
        assert sum(len(b.eligible) for b in batches) == chunk.rows_planned
        assert result.batch_log[-1].hi == chunk.hi
        assert all(0 < b.deleted < 2000 for b in result.batch_log[:-1])  # sparse: fewer rows than keys
    ledger = Ledger(policy.ledger_schema)
    assert verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks]).ok
    run = ledger.complete_run(conn, plan.run_key, "test")
    assert (run["state"], run["rows_deleted"], run["chunks_completed"]) == ("complete", expected, len(plan.chunks))


# -- invariants --------------------------------------------------------------------------------------


def test_replaying_a_complete_chunk_deletes_nothing(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema)
    chunk = one_chunk(conn, policy)
    key = plan_run(conn, policy, CUTOFF).run_key
    first = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 1))
    assert first.rows_deleted == chunk.rows_planned
    assert not first.already_complete
    before = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    # Rows inside the chunk's range become eligible after it completed: a replay must not touch them.
    rows(admin, f"UPDATE {table} SET status = 'closed' WHERE status = 'open'")
    newly = eligible_ids(admin, table)
    assert len(newly) > 100
    for try_number in (1, 1, 2):
        replay = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, try_number))
        assert replay.already_complete
        assert (replay.rows_deleted, replay.batches, replay.resumed_from) == (0, 0, None)
    assert eligible_ids(admin, table) == newly
    after = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    assert after == before
    assert (after["completed_try_number"], after["attempts"]) == (1, 1)


CHILD = """
import json, sys, time
from datetime import datetime
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.policy.model import RetentionPolicy

args = json.loads(sys.argv[1])
if args["driver"] == "psycopg":
    import psycopg
    conn = psycopg.connect(args["dsn"], application_name=args["app"])
else:
    import psycopg2
    conn = psycopg2.connect(args["dsn"], application_name=args["app"])
run_chunk(
    conn,
    RetentionPolicy.from_dict(args["policy"]),
    datetime.fromisoformat(args["cutoff"]),
    ChunkSpec(**args["chunk"]),
    attempt=Attempt("dag", "run", 0, 1, "child"),
    on_batch=lambda report: time.sleep(args["sleep"]),
)
print("finished")
"""


def test_killed_process_resumes_after_its_last_committed_batch(
    schema: str, conn: Any, admin: Any, driver: str, dsn: str, tmp_path: Path
) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    eligible = eligible_ids(admin, table)
    planned = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)
    assert len(planned) >= 4
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    app = f"retention-kill-{schema}"
    args = {
        "driver": driver,
        "dsn": dsn,
        "app": app,
        "policy": policy_to_dict(policy),
        "cutoff": CUTOFF.isoformat(),
        "chunk": {"key": chunk.key, "lo": chunk.lo, "hi": chunk.hi, "seq": chunk.seq},
        "sleep": 0.25,
    }
    stderr = tmp_path / "child.err"
    with stderr.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err
        )
    try:

        def two_batches() -> bool:
            assert child.poll() is None, f"child exited early: {stderr.read_text()}"
            return ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["batches"] >= 2

        wait_for(two_batches, 30, "two committed batches")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    gone = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(a)s"
    wait_for(lambda: scalar(admin, gone, {"a": app}) == 0, 15, "the killed session to end")

    state, next_key, deleted, batches, _ = progress(admin, policy, plan.run_key, chunk)
    assert state == "running"
    assert chunk.lo < next_key < chunk.hi
    assert batches >= 2
    assert batches < len(planned)
    # The ledger stopped exactly after its last committed batch: the first `batches` batches are gone.
    assert next_key == planned[batches - 1].hi
    assert deleted == total - scalar(admin, f"SELECT count(*) FROM {table}")
    assert deleted == sum(len(b.eligible) for b in planned[:batches])
    # Exactly the eligible rows below next_key are gone; everything from next_key on is intact.
    remaining = eligible_ids(admin, table)
    assert remaining == [i for i in eligible if i >= next_key]
    assert remaining == [i for b in planned[batches:] for i in b.eligible]

    result = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("dag", "run", 0, 2, "retry"))
    assert result.resumed_from == next_key
    assert not result.already_complete
    assert result.rows_deleted == len(remaining)
    assert eligible_ids(admin, table) == []
    assert scalar(admin, f"SELECT count(*) FROM {table}") == total - len(eligible)
    final = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert (final["state"], final["rows_deleted"], final["next_key"]) == ("complete", len(eligible), chunk.hi)
    assert (final["attempts"], final["completed_try_number"], final["completed_host"]) == (2, 2, "retry")


class Died(Exception):
    """Stands for the worker dying after the final commit, before it reported success."""


def test_retry_after_death_between_final_commit_and_success_is_a_no_op(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema)
    chunk = one_chunk(conn, policy)
    key = plan_run(conn, policy, CUTOFF).run_key
    eligible = eligible_ids(admin, table)

    def die_after_last(report: BatchReport) -> None:
        if report.hi == chunk.hi:
            raise Died

    with pytest.raises(Died):
        run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 1, "first"), on_batch=die_after_last)
    done = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    assert (done["state"], done["rows_deleted"], done["completed_try_number"]) == ("complete", len(eligible), 1)

    rows(admin, f"UPDATE {table} SET status = 'closed' WHERE status = 'open'")  # would be deleted by a rerun
    still = eligible_ids(admin, table)
    retry = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 2, "second"))
    assert retry.already_complete
    assert (retry.rows_deleted, retry.batches) == (0, 0)
    assert eligible_ids(admin, table) == still
    after = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    assert after == done
    assert (after["completed_try_number"], after["completed_host"]) == (1, "first")


def test_zombie_and_retry_at_once_serialise_on_the_ledger(schema: str, conn: Any, admin: Any, driver: str) -> None:
    table = small_table(admin, schema, 4000)
    policy = make_policy(schema)
    chunk = one_chunk(conn, policy)
    key = plan_run(conn, policy, CUTOFF).run_key
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    eligible = eligible_ids(admin, table)
    assert len(eligible) // policy.batch_size >= 15
    barrier = threading.Barrier(2)
    results: dict[int, ChunkResult] = {}
    errors: list[BaseException] = []

    def attempt(try_number: int) -> None:
        c = connect(driver)
        try:
            barrier.wait(timeout=30)
            results[try_number] = run_chunk(
                c,
                policy,
                CUTOFF,
                chunk,
                attempt=Attempt("d", "r", 0, try_number, f"worker-{try_number}"),
                on_batch=lambda report: time.sleep(0.02),
            )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=attempt, args=(n,)) for n in (1, 2)]
    start_and_join(threads, 120)
    assert errors == []
    gone = total - scalar(admin, f"SELECT count(*) FROM {table}")
    assert gone == len(eligible)
    assert eligible_ids(admin, table) == []
    assert results[1].rows_deleted + results[2].rows_deleted == gone
    assert results[1].batches > 0 and results[2].batches > 0, "the attempts did not overlap"
    final = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    assert final["state"] == "complete"
    assert final["rows_deleted"] == gone
    assert final["batches"] == results[1].batches + results[2].batches
    assert final["attempts"] == 2
    assert final["completed_try_number"] in (1, 2)
    assert final["completed_host"] == f"worker-{final['completed_try_number']}"
    assert [r.already_complete for r in results.values()] == [False, False]


def test_row_reopened_after_planning_survives(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema)
    chunk = one_chunk(conn, policy)
    planned = eligible_ids(admin, table)
    reopened, refreshed = planned[10], planned[len(planned) // 2]
    rows(admin, f"UPDATE {table} SET status = 'open' WHERE id = %(i)s", {"i": reopened})
    rows(admin, f"UPDATE {table} SET created_at = %(cutoff)s WHERE id = %(i)s", {"i": refreshed, "cutoff": CUTOFF})
    result = run_chunk(conn, policy, CUTOFF, chunk)
    assert result.rows_deleted == len(planned) - 2
    assert ids(admin, table, "id = ANY(%(i)s)", {"i": [reopened, refreshed]}) == {reopened, refreshed}
    assert eligible_ids(admin, table) == []


def test_chunk_touches_only_its_range_and_tenants(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 6000, tenant="CASE WHEN mod(g, 4) = 0 THEN 2 ELSE 1 END")
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=600)
    plan = plan_run(conn, policy, CUTOFF)
    tenant_one = [c for c in plan.chunks if c.tenants == ("1",)]
    assert len(tenant_one) >= 3
    middle = tenant_one[1]
    before = ids(admin, table)
    expected = set(eligible_ids(admin, table, extra=f"tenant_id = 1 AND id >= {middle.lo} AND id < {middle.hi}"))
    # Tenant 2's eligible rows interleave with this range: they must survive it.
    assert eligible_ids(admin, table, extra=f"tenant_id = 2 AND id >= {middle.lo} AND id < {middle.hi}")
    result = run_chunk(conn, policy, CUTOFF, middle)
    assert before - ids(admin, table) == expected
    assert result.rows_deleted == len(expected) == middle.rows_planned
    others = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert [(c["chunk_key"], c["state"]) for c in others if c["state"] != "pending"] == [(middle.key, "complete")]


def test_lock_timeout_is_retryable_and_keeps_progress(schema: str, conn: Any, admin: Any, driver: str) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema, lock_timeout="200ms")
    chunk = one_chunk(conn, policy)
    key = plan_run(conn, policy, CUTOFF).run_key
    eligible = eligible_ids(admin, table)
    first, second = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)[:2]
    assert len(first.eligible) > 0 and len(second.eligible) > 5
    done = len(first.eligible)
    holder = connect(driver)
    try:
        with holder.cursor() as cur:  # an open transaction holding a row of the second batch
            cur.execute(f"SELECT id FROM {table} WHERE id = %(i)s FOR UPDATE", {"i": second.eligible[5]})
        started = time.monotonic()
        with pytest.raises(RetryableError) as info:
            run_chunk(conn, policy, CUTOFF, chunk)
        assert time.monotonic() - started < 5
        assert info.value.sqlstate == "55P03"
        assert "lock timeout" in str(info.value)
        # The first batch committed; none of the second batch is gone; the ledger shows exactly that.
        assert eligible_ids(admin, table) == eligible[done:]
        assert progress(admin, policy, key, chunk) == ("running", first.hi, done, 1, 1)
        assert "55P03" in ledger_chunk(admin, policy.ledger_schema, key, chunk.key)["last_error"]
    finally:
        holder.rollback()
        holder.close()
    result = run_chunk(conn, policy, CUTOFF, chunk)
    assert result.resumed_from == first.hi
    assert result.rows_deleted == len(eligible) - done
    assert eligible_ids(admin, table) == []
    final = ledger_chunk(admin, policy.ledger_schema, key, chunk.key)
    assert (final["state"], final["rows_deleted"], final["last_error"]) == ("complete", len(eligible), None)


def test_statement_timeout_is_retryable_and_applies_nothing(schema: str, conn: Any, admin: Any, driver: str) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema, lock_timeout="20s", statement_timeout="300ms")
    chunk = one_chunk(conn, policy)
    key = plan_run(conn, policy, CUTOFF).run_key
    eligible = eligible_ids(admin, table)
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    holder = connect(driver)
    try:
        with holder.cursor() as cur:  # a row of the first batch
            cur.execute(f"SELECT id FROM {table} WHERE id = %(i)s FOR UPDATE", {"i": eligible[50]})
        started = time.monotonic()
        with pytest.raises(RetryableError) as info:
            run_chunk(conn, policy, CUTOFF, chunk)
        assert time.monotonic() - started < 10
        assert info.value.sqlstate == "57014"
    finally:
        holder.rollback()
        holder.close()
    assert scalar(admin, f"SELECT count(*) FROM {table}") == total
    assert eligible_ids(admin, table) == eligible
    assert progress(admin, policy, key, chunk) == ("pending", chunk.lo, 0, 0, 0)
    result = run_chunk(conn, policy, CUTOFF, chunk)
    assert result.resumed_from is None
    assert result.rows_deleted == len(eligible)


def _within(deadline: float, action: Callable[[], object], release: Callable[[], object]) -> tuple[float, Any]:
    """Run ``action`` in a thread; after ``deadline`` seconds call ``release`` so that a hung action ends
    and the test does not hang. Returns (seconds the action took, the exception it raised or None)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        started = time.monotonic()
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(deadline)
    release()
    thread.join(60)
    assert not thread.is_alive()
    return outcome["seconds"], outcome.get("error")


def _lock_ledger_row(holder: Any, policy: RetentionPolicy, run_key: str, chunk: ChunkSpec) -> None:
    """Lock the chunk's ledger row in ``holder``'s open transaction, as a batch of a stuck attempt does."""
    with holder.cursor() as cur:
        cur.execute(
            f'SELECT 1 FROM "{policy.ledger_schema}".chunks WHERE run_key = %(r)s AND chunk_key = %(c)s FOR UPDATE',
            {"r": run_key, "c": chunk.key},
        )


def test_stuck_attempt_holding_the_ledger_row_fails_the_next_one_fast(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    """A zombie stuck inside a batch transaction (frozen process, lost network) holds the chunk's ledger
    row. The retry must give up after the policy's lock_timeout with a RetryableError, not wait forever."""
    table = small_table(admin, schema)
    policy = make_policy(schema, lock_timeout="200ms")
    plan = plan_run(conn, policy, CUTOFF)
    eligible = eligible_ids(admin, table)
    holder = connect(driver)
    try:
        _lock_ledger_row(holder, policy, plan.run_key, plan.chunks[0])
        seconds, error = _within(3, lambda: run_chunk(conn, policy, CUTOFF, plan.chunks[0]), holder.rollback)
    finally:
        holder.close()
    assert seconds < 2, f"run_chunk waited {seconds:.1f}s for the ledger row despite lock_timeout=200ms"
    assert isinstance(error, RetryableError)
    assert error.sqlstate == "55P03"
    assert eligible_ids(admin, table) == eligible


def test_ledger_row_locked_between_batches_fails_fast(schema: str, conn: Any, admin: Any, driver: str) -> None:
    """The same between two batches: the batch's own lock of the ledger row times out (55P03), and
    recording that error must not then wait for the very lock that timed out."""
    table = small_table(admin, schema)
    policy = make_policy(schema, lock_timeout="200ms")
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    eligible = eligible_ids(admin, table)
    first = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)[0]
    assert len(first.eligible) > 0
    holder = connect(driver)

    def lock_after_first(report: BatchReport) -> None:
        if report.lo == chunk.lo:
            _lock_ledger_row(holder, policy, plan.run_key, chunk)

    try:
        seconds, error = _within(
            3, lambda: run_chunk(conn, policy, CUTOFF, chunk, on_batch=lock_after_first), holder.rollback
        )
    finally:
        holder.close()
    assert isinstance(error, RetryableError)
    assert error.sqlstate == "55P03"
    assert seconds < 2, f"run_chunk took {seconds:.1f}s to report a 200ms lock timeout"
    assert eligible_ids(admin, table) == eligible[len(first.eligible) :]
    assert progress(admin, policy, plan.run_key, chunk)[1:4] == (first.hi, len(first.eligible), 1)


def test_timeouts_are_set_per_transaction(schema: str, conn: Any, admin: Any) -> None:
    small_table(admin, schema, 500)
    policy = make_policy(schema, lock_timeout="1234ms", statement_timeout="4321ms")

    def settings() -> tuple[str, str]:
        with conn.cursor() as cur:
            cur.execute("SHOW lock_timeout")
            lock = cur.fetchone()[0]
            cur.execute("SHOW statement_timeout")
            statement = cur.fetchone()[0]
        conn.rollback()
        return lock, statement

    default = settings()
    assert "1234ms" not in default
    seen: list[tuple[str, str]] = []
    result = run_chunk(conn, policy, CUTOFF, one_chunk(conn, policy), on_batch=lambda report: seen.append(settings()))
    assert result.batches >= 2
    assert seen == [default] * result.batches  # between batches: back to the session's values
    assert settings() == default


def test_dry_run_counts_and_deletes_nothing(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    snapshot = rows(admin, f"SELECT * FROM {table} ORDER BY id")
    eligible = eligible_ids(admin, table)
    policy = make_policy(schema, dry_run=True, chunk_rows=500)
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.run_key.endswith("#dry-run")
    assert len(plan.chunks) == 4
    results = [run_chunk(conn, policy, CUTOFF, chunk) for chunk in plan.chunks]
    assert sum(r.rows_matched for r in results) == len(eligible)
    assert [r.rows_matched for r in results] == [c.rows_planned for c in plan.chunks]
    assert sum(r.rows_deleted for r in results) == 0
    assert rows(admin, f"SELECT * FROM {table} ORDER BY id") == snapshot
    chunks = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert {(c["state"], c["outcome"], c["rows_deleted"]) for c in chunks} == {("complete", "dry_run", 0)}
    assert sum(c["rows_matched"] for c in chunks) == len(eligible)
    # The real run of the same cutoff is a run of its own.
    real = plan_run(conn, make_policy(schema, chunk_rows=500), CUTOFF)
    assert not real.reused
    assert not real.run_key.endswith("#dry-run")


def test_archive_receives_exactly_the_deleted_rows(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    archive = f'"{schema}".events_archive'
    rows(admin, f"CREATE TABLE {archive} (LIKE {table})")
    expected = rows(admin, f"SELECT * FROM {table} WHERE {ELIGIBLE} ORDER BY id", {"cutoff": CUTOFF})
    policy = make_policy(schema, archive_table=f"{schema}.events_archive", chunk_rows=400)
    plan = plan_run(conn, policy, CUTOFF)
    results = [run_chunk(conn, policy, CUTOFF, chunk) for chunk in plan.chunks]
    assert rows(admin, f"SELECT * FROM {archive} ORDER BY id") == expected
    assert eligible_ids(admin, table) == []
    assert sum(r.rows_archived for r in results) == sum(r.rows_deleted for r in results) == len(expected)
    chunks = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert sum(c["rows_archived"] for c in chunks) == len(expected)


def test_chunk_key_recorded_with_another_range_is_refused(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema)
    policy = make_policy(schema, tenant_column="tenant_id")
    plan = plan_run(conn, policy, CUTOFF)
    chunk = plan.chunks[0]
    before = ids(admin, table)
    for impostor in (
        ChunkSpec(key=chunk.key, lo=chunk.lo, hi=chunk.hi + 1000, tenants=chunk.tenants),
        ChunkSpec(key=chunk.key, lo=chunk.lo + 1, hi=chunk.hi, tenants=chunk.tenants),
        ChunkSpec(key=chunk.key, lo=chunk.lo, hi=chunk.hi, tenants=("99",)),
    ):
        with pytest.raises(PermanentError, match="chunk keys must identify one range"):
            run_chunk(conn, policy, CUTOFF, impostor)
    assert ids(admin, table) == before
    assert progress(admin, policy, plan.run_key, chunk)[:3] == ("pending", chunk.lo, 0)


def test_malformed_chunks_are_refused(schema: str, conn: Any, admin: Any) -> None:
    small_table(admin, schema, 100)
    with pytest.raises(PermanentError, match="range"):
        run_chunk(conn, make_policy(schema), CUTOFF, ChunkSpec("x", 10, 10))
    with pytest.raises(PermanentError, match="no tenant_column"):
        run_chunk(conn, make_policy(schema), CUTOFF, ChunkSpec("y", 1, 10, tenants=("1",)))
    with pytest.raises(PermanentError, match="no time zone"):
        run_chunk(conn, make_policy(schema), CUTOFF.replace(tzinfo=None), ChunkSpec("z", 1, 10))


def test_lone_chunk_without_a_plan(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema, 1000)
    policy = make_policy(schema, tenant_column="tenant_id")
    expected = set(eligible_ids(admin, table, extra="tenant_id = 2 AND id < 500"))
    before = ids(admin, table)
    chunk = ChunkSpec("lone", 1, 500, tenants=("2",))
    with pytest.raises(PermanentError, match="not in the ledger's plan"):
        run_chunk(conn, policy, CUTOFF, chunk)  # a planned chunk must be in a plan
    assert ids(admin, table) == before
    result = run_chunk(conn, policy, CUTOFF, chunk, lone=True)
    assert before - ids(admin, table) == expected
    assert result.rows_deleted == len(expected)
    assert result.run_key.endswith("#lone")
    run = ledger_run(admin, policy.ledger_schema, result.run_key)
    assert run is not None
    assert run["state"] == "planned"
    # The lone run never stands in for the planned run of the same cutoff.
    plan = plan_run(conn, policy, CUTOFF)
    assert not plan.reused and plan.run_key != result.run_key


def test_timestamp_without_time_zone_is_read_as_utc(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema, ts_type="timestamp")
    naive = CUTOFF.replace(tzinfo=None)
    rows(
        admin,
        f"INSERT INTO {table} (id, tenant_id, created_at, status) VALUES"
        " (1, 1, %(n)s::timestamp - interval '1 microsecond', 'closed'),"
        " (2, 1, %(n)s::timestamp, 'closed'),"
        " (3, 1, %(n)s::timestamp - interval '1 hour', 'closed'),"
        " (4, 1, %(n)s::timestamp + interval '1 hour', 'closed')",
        {"n": naive},
    )
    with conn.cursor() as cur:  # a session time zone far from UTC must not move the cutoff
        cur.execute("SET TIME ZONE 'Pacific/Kiritimati'")
    conn.commit()
    policy = make_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.rows_planned == 2
    for chunk in plan.chunks:
        run_chunk(conn, policy, CUTOFF, chunk)
    assert ids(admin, table) == {2, 4}


def test_mixed_case_and_reserved_names(schema: str, conn: Any, admin: Any) -> None:
    table = f'"{schema}"."Order"'
    rows(
        admin,
        f'CREATE TABLE {table} ("user" bigint PRIMARY KEY, "Group" text, "select" timestamptz NOT NULL, status text)',
    )
    rows(admin, f'CREATE INDEX ON {table} ("select")')
    rows(admin, f'CREATE INDEX ON {table} ("Group", "user")')
    rows(
        admin,
        f"INSERT INTO {table} SELECT g, 'T' || mod(g, 3),"
        " %(cutoff)s::timestamptz + (mod(g, 10) - 5) * interval '1 day',"
        " CASE WHEN mod(g, 7) = 0 THEN 'open' ELSE 'closed' END FROM generate_series(1, 1000) g",
        {"cutoff": CUTOFF},
    )
    where = "\"select\" < %(cutoff)s AND status <> 'open'"
    expected = scalar(admin, f"SELECT count(*) FROM {table} WHERE {where}", {"cutoff": CUTOFF})
    policy = make_policy(
        schema,
        table=f"{schema}.Order",
        key_column="user",
        timestamp_column="select",
        tenant_column="Group",
        chunk_rows=200,
    )
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.rows_planned == expected
    deleted = sum(run_chunk(conn, policy, CUTOFF, chunk).rows_deleted for chunk in plan.chunks)
    assert deleted == expected
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE {where}", {"cutoff": CUTOFF}) == 0
    assert scalar(admin, f"SELECT count(*) FROM {table}") == 1000 - expected


TENANT_NAMES = ["NULL", "null", "a,b", 'x"y', "{z}", "back\\slash", " spaced ", "", "o'neil", "ü"]


def test_text_tenants_with_awkward_names(schema: str, conn: Any, admin: Any) -> None:
    """Tenant values travel as text[] parameters and in the ledger: quotes, commas, braces, 'NULL' and
    the empty string must each reach exactly their own rows."""
    table = create_events(admin, schema, tenant_type="text")
    rows(admin, f'CREATE TABLE "{schema}".names (i int, n text)')
    for i, name in enumerate(TENANT_NAMES):
        rows(admin, f'INSERT INTO "{schema}".names VALUES (%(i)s, %(n)s)', {"i": i, "n": name})
    pick = f'(SELECT n FROM "{schema}".names WHERE i = mod(g, {len(TENANT_NAMES)}))'
    fill_events(admin, table, 2000, tenant=pick)
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=150)
    plan = plan_run(conn, policy, CUTOFF)
    assert sorted(t for c in plan.chunks for t in (c.tenants or ())) == sorted(TENANT_NAMES)
    stored = Ledger(policy.ledger_schema).stored_plan(conn, plan.run_key)
    assert [c.tenants for c in stored] == [c.tenants for c in plan.chunks]
    for chunk in plan.chunks:
        (tenant,) = chunk.tenants or ("?",)
        expected = set(eligible_ids(admin, table, extra=f"tenant_id = {_literal(tenant)}"))
        before = ids(admin, table)
        assert run_chunk(conn, policy, CUTOFF, chunk).rows_deleted == len(expected) == chunk.rows_planned
        assert before - ids(admin, table) == expected
    assert eligible_ids(admin, table) == []


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def test_autocommit_connection_is_handled(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema, 1000)
    eligible = eligible_ids(admin, table)
    conn.autocommit = True
    policy = make_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    result = run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    assert result.rows_deleted == len(eligible)
    assert eligible_ids(admin, table) == []
    assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, plan.chunks[0].key)["rows_deleted"] == len(eligible)


@pytest.mark.parametrize("condition", ["status = E'\\'' ) or (true --'", "status = $a1$'$a1$ ) or (true --'"])
def test_condition_never_makes_fresh_rows_eligible(schema: str, conn: Any, admin: Any, condition: str) -> None:
    """A condition that passes validation must stay inside its parentheses. These hide ") or (true"
    from the checker (a backslash escape string; a dollar quote with a digit in its tag); accepted,
    they make every row of the table eligible, whatever its age."""
    table = small_table(admin, schema, 500)
    fresh = ids(admin, table, "created_at >= %(cutoff)s")
    try:
        policy = make_policy(schema, condition=condition)
    except PolicyError:
        return  # refused at validation: nothing can be deleted
    for chunk in plan_run(conn, policy, CUTOFF).chunks:
        run_chunk(conn, policy, CUTOFF, chunk)
    assert ids(admin, table, "created_at >= %(cutoff)s") == fresh, "rows newer than the cutoff were deleted"


# -- packed chunks of small tenants -------------------------------------------------------------------


def packed_table(admin: Any, schema: str) -> tuple[str, RetentionPolicy]:
    """Tenants 1..5 (about 400 rows each) interleaved with a big tenant 100 (4000 rows) over one key range;
    the small tenants share one planned chunk, the big one has chunks of its own."""
    table = create_events(admin, schema)
    fill_events(admin, table, 6000, tenant="CASE WHEN mod(g, 3) = 0 THEN 1 + mod(g / 3, 5) ELSE 100 END")
    policy = make_policy(schema, tenant_column="tenant_id", batch_size=50, chunk_rows=1500)
    return table, policy


def _packed_chunk(conn: Any, policy: RetentionPolicy) -> tuple[Any, ChunkSpec]:
    plan = plan_run(conn, policy, CUTOFF)
    (packed,) = [c for c in plan.chunks if c.tenants is not None and len(c.tenants) > 1]
    assert sorted(packed.tenants or ()) == ["1", "2", "3", "4", "5"]
    assert any(c.tenants == ("100",) for c in plan.chunks)
    return plan, packed


def test_packed_chunk_walks_its_tenants_one_at_a_time(schema: str, conn: Any, admin: Any) -> None:
    table, policy = packed_table(admin, schema)
    plan, chunk = _packed_chunk(conn, policy)
    tenants = list(chunk.tenants or ())
    in_range = f"id >= {chunk.lo} AND id < {chunk.hi}"
    mine = set(eligible_ids(admin, table, extra=f"tenant_id IN ({', '.join(tenants)})"))
    others_before = ids(admin, table, f"tenant_id = 100 AND {in_range}")
    assert set(eligible_ids(admin, table, extra=f"tenant_id = 100 AND {in_range}"))  # they interleave
    planned = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size, tenants=tenants)
    positions: list[tuple[int, int]] = []

    def watch(report: BatchReport) -> None:
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        positions.append((row["tenant_pos"], row["next_key"]))

    before = ids(admin, table)
    result = run_chunk(conn, policy, CUTOFF, chunk, on_batch=watch)
    assert before - ids(admin, table) == mine
    assert ids(admin, table, f"tenant_id = 100 AND {in_range}") == others_before
    assert result.rows_deleted == len(mine) == chunk.rows_planned
    assert [(b.tenant, b.lo, b.hi, b.deleted) for b in result.batch_log] == [
        (b.tenant, b.lo, b.hi, len(b.eligible)) for b in planned
    ]
    assert all(len(b.keys) <= policy.batch_size for b in planned)
    # The ledger's position: each tenant in turn, from chunk.lo again for the next one.
    expected_positions = []
    for i, b in enumerate(planned):
        last_of_tenant = i + 1 == len(planned) or planned[i + 1].tenant != b.tenant
        if not last_of_tenant:
            expected_positions.append((tenants.index(b.tenant), b.hi))
        elif i + 1 < len(planned):
            expected_positions.append((tenants.index(b.tenant) + 1, chunk.lo))
        else:
            expected_positions.append((len(tenants) - 1, chunk.hi))
    assert positions == expected_positions
    assert [p for p, _ in positions] == sorted(p for p, _ in positions)
    assert {p for p, _ in positions} == set(range(len(tenants)))
    final = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert (final["state"], final["rows_deleted"], final["batches"]) == ("complete", len(mine), len(planned))


@pytest.mark.parametrize("stop", ["inside the second tenant", "between tenants"])
def test_packed_chunk_killed_mid_tenant_resumes_there(schema: str, conn: Any, admin: Any, stop: str) -> None:
    table, policy = packed_table(admin, schema)
    plan, chunk = _packed_chunk(conn, policy)
    tenants = list(chunk.tenants or ())
    mine = eligible_ids(admin, table, extra=f"tenant_id IN ({', '.join(tenants)})")
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    planned = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size, tenants=tenants)
    first_of_second = next(i for i, b in enumerate(planned) if b.tenant == tenants[1])
    # Die after the second tenant's first batch, or after the first tenant's last one.
    last = first_of_second if stop == "inside the second tenant" else first_of_second - 1
    seen: list[BatchReport] = []

    def die(report: BatchReport) -> None:
        seen.append(report)
        if len(seen) == last + 1:
            raise Died

    with pytest.raises(Died):
        run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 1), on_batch=die)
    done = planned[: last + 1]
    gone = sum(len(b.eligible) for b in done)
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    resume_at = (1, planned[last].hi) if stop == "inside the second tenant" else (1, chunk.lo)
    assert (row["state"], row["tenant_pos"], row["next_key"]) == ("running", *resume_at)
    assert row["rows_deleted"] == gone == total - scalar(admin, f"SELECT count(*) FROM {table}")
    assert set(mine) - set(eligible_ids(admin, table)) == {i for b in done for i in b.eligible}

    retry = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 2))
    assert retry.resumed_from == resume_at[1]
    assert [(b.tenant, b.lo, b.hi, b.deleted) for b in retry.batch_log] == [
        (b.tenant, b.lo, b.hi, len(b.eligible)) for b in planned[last + 1 :]
    ]
    assert retry.rows_deleted == len(mine) - gone
    assert eligible_ids(admin, table, extra=f"tenant_id IN ({', '.join(tenants)})") == []
    # Each row deleted once: the ledger's count is exactly what left the table.
    final = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert (final["state"], final["attempts"]) == ("complete", 2)
    assert final["rows_deleted"] == len(mine) == total - scalar(admin, f"SELECT count(*) FROM {table}")


@pytest.mark.solo
def test_batches_write_compressed_full_page_images_when_told(schema: str, conn: Any, admin: Any) -> None:
    """After a checkpoint each page's first change writes the whole page to the WAL; with wal_compression
    set in the batches those images are compressed, and the purge writes much less WAL."""
    (values,) = rows(admin, "SELECT enumvals FROM pg_catalog.pg_settings WHERE name = 'wal_compression'")[0]
    method = "lz4" if "lz4" in values else "pglz"
    wal = {}
    for setting in ("off", method):
        table = create_events(admin, schema, f"events_{setting}")
        fill_events(admin, table, 20_000)
        # Rows of repetitive text, as logs and JSON are: the images compress far below the threshold
        # below, so that other sessions' WAL written meanwhile (the WAL is the server's) cannot close it.
        rows(admin, f"UPDATE {table} SET payload = repeat('retention ' || mod(id, 10), 40)")
        rows(admin, f"VACUUM FULL {table}")
        policy = make_policy(
            schema,
            name=f"purge_{setting}",
            table=f"{schema}.events_{setting}",
            wal_compression=setting,
            batch_size=5_000,
        )
        plan = plan_run(conn, policy, CUTOFF)
        rows(admin, "CHECKPOINT")
        (before,) = rows(admin, "SELECT pg_current_wal_lsn()")[0]
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        wal[setting] = int(scalar(admin, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %(b)s::pg_lsn)", {"b": before}))
        assert eligible_ids(admin, table) == []
    assert wal[method] < 0.7 * wal["off"], wal


@pytest.mark.parametrize(("setting", "in_batches"), [("off", "off"), ("server", "on")])
def test_batches_commit_asynchronously_and_the_chunks_completion_durably(
    schema: str, conn: Any, admin: Any, setting: str, in_batches: str
) -> None:
    """With ``synchronous_commit: off`` every batch commits without waiting for its WAL; the transaction
    that completes the chunk commits with the server's setting (``on`` here), so that a chunk reported
    done survives a crash."""
    assert scalar(admin, "SELECT setting FROM pg_catalog.pg_settings WHERE name = 'synchronous_commit'") == "on"
    table = create_events(admin, schema)
    fill_events(admin, table, 12_000)
    policy = make_policy(schema, synchronous_commit=setting, batch_size=1000, max_batch_size=1000)
    plan = plan_run(conn, policy, CUTOFF)
    # What the batches' DELETEs and the completing ledger writes saw, recorded by triggers of the test's own.
    rows(admin, f'CREATE TABLE "{schema}".seen (what text, setting text)')
    rows(
        admin,
        f'CREATE FUNCTION "{schema}".note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN'
        f" INSERT INTO \"{schema}\".seen VALUES (TG_ARGV[0], current_setting('synchronous_commit'));"
        " RETURN NULL; END $$",
    )
    rows(
        admin,
        f"CREATE TRIGGER seen_delete AFTER DELETE ON {table} FOR EACH STATEMENT"
        f" EXECUTE FUNCTION \"{schema}\".note('delete')",
    )
    rows(
        admin,
        f'CREATE TRIGGER seen_complete AFTER UPDATE ON "{policy.ledger_schema}".chunks FOR EACH ROW'
        f" WHEN (NEW.state = 'complete' AND OLD.state <> 'complete') EXECUTE FUNCTION \"{schema}\".note('complete')",
    )
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert eligible_ids(admin, table) == []
    seen = rows(admin, f'SELECT what, setting, count(*) FROM "{schema}".seen GROUP BY 1, 2 ORDER BY 1, 2')
    batches = sum(n for what, _, n in seen if what == "delete")
    assert batches > len(plan.chunks)  # several batches per chunk
    assert seen == [("complete", "on", len(plan.chunks)), ("delete", in_batches, batches)]
