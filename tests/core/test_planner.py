"""The planner on the real PostgreSQL (both drivers): deterministic, bounded chunks covering every
eligible row exactly once, planned once per run."""

from __future__ import annotations

import itertools
import logging
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger import ChunkSpec
from airflow_retention.core.planner import MAX_TENANTS_PER_CHUNK, Plan, Preview, compute_plan, plan_run
from airflow_retention.core.policy import RetentionPolicy
from tests.conftest import connect

from .helpers import (
    CUTOFF,
    ELIGIBLE,
    create_events,
    eligible_ids,
    fill_events,
    ledger_chunks,
    ledger_run,
    make_policy,
    rows,
    scalar,
    start_and_join,
)

OLD = "%(cutoff)s::timestamptz - interval '1 day' - g * interval '1 second'"


def chunk_counts(admin: Any, table: str, chunks: list[ChunkSpec]) -> list[int]:
    """Eligible rows of each chunk, counted by the tests' own SQL."""
    return [
        scalar(
            admin,
            f"SELECT count(*) FROM {table} WHERE {ELIGIBLE} AND id >= %(lo)s AND id < %(hi)s"
            " AND (%(all)s OR tenant_id::text = ANY(%(tenants)s))",
            {
                "cutoff": CUTOFF,
                "lo": c.lo,
                "hi": c.hi,
                "all": c.tenants is None,
                "tenants": list(c.tenants or ()),
            },
        )
        for c in chunks
    ]


def uncovered(admin: Any, table: str, policy: RetentionPolicy, plan: Plan) -> list[tuple[int, int]]:
    """Eligible rows not in exactly one of the run's chunks (as the ledger holds them): (id, chunks)."""
    return rows(
        admin,
        f"SELECT e.id, count(c.chunk_key) FROM {table} e"
        f' LEFT JOIN "{policy.ledger_schema}".chunks c ON c.run_key = %(run)s AND e.id >= c.lo AND e.id < c.hi'
        "  AND (c.tenants IS NULL OR e.tenant_id::text = ANY(c.tenants))"
        f" WHERE {ELIGIBLE.replace('created_at', 'e.created_at').replace('status', 'e.status')}"
        " GROUP BY e.id HAVING count(c.chunk_key) <> 1 ORDER BY e.id LIMIT 20",
        {"cutoff": CUTOFF, "run": plan.run_key},
    )


def shape(plan: Plan) -> list[tuple[Any, ...]]:
    return [(c.key, c.seq, c.tenants, c.lo, c.hi, c.rows_planned) for c in plan.chunks]


def skewed_table(admin: Any, schema: str) -> str:
    """Tenant 1: 12,000 rows; tenants 2..4: 1,000 each; tenants 10..59: 30 each. Default mix of ages/status."""
    table = create_events(admin, schema)
    fill_events(admin, table, 12_000, tenant="1")
    fill_events(admin, table, 3_000, first_id=12_001, tenant="2 + mod(g, 3)")
    fill_events(admin, table, 1_500, first_id=15_001, tenant="10 + mod(g, 50)")
    return table


def test_plan_is_deterministic(schema: str, conn: Any, admin: Any) -> None:
    table = skewed_table(admin, schema)
    first = plan_run(conn, make_policy(schema, name="first", tenant_column="tenant_id", chunk_rows=1000), CUTOFF)
    second = plan_run(conn, make_policy(schema, name="second", tenant_column="tenant_id", chunk_rows=1000), CUTOFF)
    assert not first.reused
    assert not second.reused
    assert first.run_key != second.run_key
    assert shape(first) == shape(second)
    assert first.rows_planned == second.rows_planned == len(eligible_ids(admin, table))
    assert [c.seq for c in first.chunks] == list(range(len(first.chunks)))
    assert len({c.key for c in first.chunks}) == len(first.chunks)
    kwargs = first.expand_kwargs()
    assert [k["chunk_key"] for k in kwargs] == [c.key for c in first.chunks]
    assert {k["cutoff"] for k in kwargs} == {"2024-06-01T12:00:00Z"}


def test_second_plan_of_a_run_reuses_the_stored_plan(schema: str, conn: Any, admin: Any) -> None:
    table = skewed_table(admin, schema)
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=1000)
    first = plan_run(conn, policy, CUTOFF)
    # More rows become eligible: held-back rows are released, old rows arrive in new key ranges.
    rows(admin, f"UPDATE {table} SET status = 'closed' WHERE status = 'open'")
    fill_events(admin, table, 5_000, first_id=20_001, tenant="1", created=OLD, status="'closed'")
    assert len(eligible_ids(admin, table)) > first.rows_planned + 5_000
    again = plan_run(conn, policy, CUTOFF)
    assert again.reused
    assert again.run_key == first.run_key
    assert shape(again) == shape(first)
    assert (again.rows_planned, again.chunk_rows) == (first.rows_planned, first.chunk_rows)
    assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == 1
    assert len(ledger_chunks(admin, policy.ledger_schema, first.run_key)) == len(first.chunks)


@pytest.mark.parametrize("tenant_column", [None, "tenant_id"])
def test_chunks_are_bounded_and_cover_every_eligible_row_once(
    schema: str, conn: Any, admin: Any, tenant_column: str | None
) -> None:
    table = skewed_table(admin, schema)
    policy = make_policy(schema, tenant_column=tenant_column, chunk_rows=700)
    plan = plan_run(conn, policy, CUTOFF)
    counts = chunk_counts(admin, table, plan.chunks)
    assert max(counts) <= 700
    assert counts == [c.rows_planned for c in plan.chunks]
    assert sum(counts) == plan.rows_planned == len(eligible_ids(admin, table))
    stored = [
        (c["chunk_key"], c["lo"], c["hi"], c["rows_planned"])
        for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    ]
    assert stored == [(c.key, c.lo, c.hi, c.rows_planned) for c in plan.chunks]
    assert uncovered(admin, table, policy, plan) == []
    run = ledger_run(admin, policy.ledger_schema, plan.run_key)
    assert run is not None
    assert (run["state"], run["chunks_expected"], run["rows_planned"]) == (
        "planned",
        len(plan.chunks),
        plan.rows_planned,
    )


@pytest.mark.parametrize(("tenant_sql", "tenant_column"), [("1", None), ("1 + mod(g, 8)", "tenant_id")])
def test_max_chunks_grows_chunk_rows(
    schema: str, conn: Any, admin: Any, tenant_sql: str, tenant_column: str | None
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 8000, tenant=tenant_sql, created=OLD, status="'closed'")
    unbounded = plan_run(
        conn, make_policy(schema, name="unbounded", chunk_rows=200, tenant_column=tenant_column), CUTOFF
    )
    assert len(unbounded.chunks) == 40
    assert unbounded.chunk_rows == 200
    policy = make_policy(schema, name="bounded", chunk_rows=200, tenant_column=tenant_column)
    plan = plan_run(conn, policy, CUTOFF, max_chunks=5)
    assert 1 <= len(plan.chunks) <= 5
    assert plan.chunk_rows > 200
    counts = chunk_counts(admin, table, plan.chunks)
    assert max(counts) <= plan.chunk_rows
    assert sum(counts) == plan.rows_planned == 8000
    assert uncovered(admin, table, policy, plan) == []
    run = ledger_run(admin, policy.ledger_schema, plan.run_key)
    assert run is not None
    assert run["chunk_rows"] == plan.chunk_rows


def test_skewed_tenants(schema: str, conn: Any, admin: Any) -> None:
    """A tenant with 50x the rows gets 50x the chunks; a hundred tiny tenants share one chunk."""
    table = create_events(admin, schema)
    fill_events(admin, table, 50_000, tenant="1", created=OLD, status="'closed'")
    fill_events(admin, table, 1_000, first_id=50_001, tenant="2", created=OLD, status="'closed'")
    fill_events(admin, table, 1_000, first_id=51_001, tenant="100 + mod(g, 100)", created=OLD, status="'closed'")
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=1000)
    plan = plan_run(conn, policy, CUTOFF)
    by_tenants: dict[tuple[str, ...] | None, list[ChunkSpec]] = {}
    for chunk in plan.chunks:
        by_tenants.setdefault(chunk.tenants, []).append(chunk)
    assert len(by_tenants[("1",)]) == 50
    assert len(by_tenants[("2",)]) == 1
    shared = [c for c in plan.chunks if c.tenants is not None and len(c.tenants) > 1]
    assert len(shared) == 1
    assert shared[0].tenants == tuple(str(t) for t in range(100, 200))
    assert len(plan.chunks) == 52
    assert chunk_counts(admin, table, plan.chunks) == [1000] * 52
    # The noisy tenant's chunks tile its key range without gaps or overlap.
    noisy = sorted(by_tenants[("1",)], key=lambda c: c.lo)
    assert all(a.hi == b.lo for a, b in itertools.pairwise(noisy))
    assert uncovered(admin, table, policy, plan) == []


def test_tiny_tenants_per_chunk_are_bounded(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 1200, tenant="g", created=OLD, status="'closed'")
    policy = make_policy(schema, tenant_column="tenant_id")
    plan = plan_run(conn, policy, CUTOFF)
    assert [len(c.tenants or ()) for c in plan.chunks] == [MAX_TENANTS_PER_CHUNK, MAX_TENANTS_PER_CHUNK, 200]
    assert uncovered(admin, table, policy, plan) == []


def test_rows_with_null_tenant_are_not_planned(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 100, tenant="CASE WHEN g <= 30 THEN NULL ELSE 1 END", created=OLD, status="'closed'")
    with caplog.at_level(logging.WARNING, logger="airflow_retention.core.planner"):
        plan = plan_run(conn, make_policy(schema, tenant_column="tenant_id"), CUTOFF)
    assert plan.rows_planned == 70
    assert [(c.tenants, c.lo, c.hi) for c in plan.chunks] == [(("1",), 31, 101)]
    assert any("30 eligible row(s) have a NULL tenant_id" in r.getMessage() for r in caplog.records)


def test_empty_plan_records_a_complete_run(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    # Old rows held back by the condition, and fresh rows: nothing is eligible.
    fill_events(admin, table, 500, created=OLD, status="'open'")
    fill_events(admin, table, 500, first_id=501, created="%(cutoff)s::timestamptz + g * interval '1 second'")
    policy = make_policy(schema, tenant_column="tenant_id")
    plan = plan_run(conn, policy, CUTOFF)
    assert (plan.chunks, plan.rows_planned, plan.reused) == ([], 0, False)
    run = ledger_run(admin, policy.ledger_schema, plan.run_key)
    assert run is not None
    assert (run["state"], run["chunks_expected"], run["rows_deleted"], run["chunks_completed"]) == ("complete", 0, 0, 0)
    assert run["completed_at"] is not None
    assert ledger_chunks(admin, policy.ledger_schema, plan.run_key) == []
    assert scalar(admin, f"SELECT count(*) FROM {table}") == 1000
    assert plan_run(conn, policy, CUTOFF).reused


def test_cutoff_in_the_future_is_refused(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 100)
    policy = make_policy(schema)
    future = datetime.now(timezone.utc) + timedelta(hours=1)
    with pytest.raises(PermanentError, match="in the future"):
        plan_run(conn, policy, future)
    assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == 0


def test_cutoff_without_time_zone_is_refused(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema)
    with pytest.raises(PermanentError, match="no time zone"):
        plan_run(conn, make_policy(schema), CUTOFF.replace(tzinfo=None))


def test_max_chunks_below_one_is_refused(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema)
    with pytest.raises(PermanentError, match="max_chunks"):
        plan_run(conn, make_policy(schema), CUTOFF, max_chunks=0)


def test_cutoff_in_another_zone_is_the_same_run(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 300)
    policy = make_policy(schema, chunk_rows=100)
    first = plan_run(conn, policy, CUTOFF)
    shifted = plan_run(conn, policy, CUTOFF.astimezone(timezone(timedelta(hours=-5))))
    assert shifted.reused
    assert shifted.run_key == first.run_key == "events_purge@2024-06-01T12:00:00Z"
    assert shape(shifted) == shape(first)


def test_concurrent_planners_of_one_run_agree(schema: str, conn: Any, admin: Any, driver: str) -> None:
    """Planners racing on a fresh ledger: one plan is stored, every caller gets it."""
    table = skewed_table(admin, schema)
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=1000)
    callers = 4
    barrier = threading.Barrier(callers)
    plans: list[Plan] = []
    errors: list[BaseException] = []

    def work() -> None:
        c = connect(driver)
        try:
            barrier.wait(timeout=30)
            plans.append(plan_run(c, policy, CUTOFF))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work) for _ in range(callers)]
    start_and_join(threads, 60)
    assert errors == []
    assert len(plans) == callers
    assert sum(not p.reused for p in plans) == 1
    assert all(shape(p) == shape(plans[0]) for p in plans)
    assert len(ledger_chunks(admin, policy.ledger_schema, plans[0].run_key)) == len(plans[0].chunks)
    assert plans[0].rows_planned == len(eligible_ids(admin, table))


def test_more_tenants_than_max_chunks_can_hold(schema: str, conn: Any, admin: Any) -> None:
    """1,200 tenants cannot fit in 2 chunks of at most 500 tenants each, whatever the chunk size: the
    planner must say so (PermanentError, nothing registered) or plan within the bound; not crash."""
    table = create_events(admin, schema)
    fill_events(admin, table, 1200, tenant="g", created=OLD, status="'closed'")
    policy = make_policy(schema, tenant_column="tenant_id")
    try:
        plan = plan_run(conn, policy, CUTOFF, max_chunks=2)
    except PermanentError:
        assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == 0
        return
    assert len(plan.chunks) <= 2
    assert uncovered(admin, table, policy, plan) == []


def _schema_exists(admin: Any, name: str) -> bool:
    return bool(scalar(admin, "SELECT count(*) FROM pg_namespace WHERE nspname = %(n)s", {"n": name}))


@pytest.mark.parametrize("tenant_column", [None, "tenant_id"])
def test_compute_plan_writes_nothing_and_matches_plan_run(
    schema: str, conn: Any, admin: Any, tenant_column: str | None
) -> None:
    table = skewed_table(admin, schema)
    rows(admin, f"ALTER TABLE {table} ALTER COLUMN created_at DROP NOT NULL")
    rows(admin, f"UPDATE {table} SET created_at = NULL WHERE id IN (5, 6, 7)")  # reported, never planned
    policy = make_policy(schema, tenant_column=tenant_column, chunk_rows=1000)
    preview = compute_plan(conn, policy, CUTOFF, max_chunks=100)
    assert isinstance(preview, Preview)
    assert not _schema_exists(admin, policy.ledger_schema)  # no ledger schema, no tables
    assert preview.rows_planned == len(eligible_ids(admin, table)) == sum(c.rows_planned or 0 for c in preview.chunks)
    assert preview.null_timestamps == 3
    assert preview.tenant_groups == (1 if tenant_column is None else 54)
    assert chunk_counts(admin, table, preview.chunks) == [c.rows_planned for c in preview.chunks]
    plan = plan_run(conn, policy, CUTOFF, max_chunks=100)
    assert _schema_exists(admin, policy.ledger_schema)
    assert (plan.run_key, plan.rows_planned, plan.chunk_rows) == (
        preview.run_key,
        preview.rows_planned,
        preview.chunk_rows,
    )
    assert shape(plan) == [(c.key, c.seq, c.tenants, c.lo, c.hi, c.rows_planned) for c in preview.chunks]


def test_compute_plan_grows_chunk_rows_like_plan_run(schema: str, conn: Any, admin: Any) -> None:
    skewed_table(admin, schema)
    policy = make_policy(schema, tenant_column="tenant_id", chunk_rows=500)
    preview = compute_plan(conn, policy, CUTOFF, max_chunks=8)
    assert len(preview.chunks) <= 8 and preview.chunk_rows > 500
    assert not _schema_exists(admin, policy.ledger_schema)
    with pytest.raises(PermanentError, match="in the future"):
        compute_plan(conn, policy, datetime.now(timezone.utc) + timedelta(days=2))
    assert not _schema_exists(admin, policy.ledger_schema)


def test_plan_run_prunes_the_policys_old_runs(schema: str, conn: Any, admin: Any) -> None:
    skewed_table(admin, schema)
    policy = make_policy(schema, chunk_rows=5000, ledger_keep_days=40)
    other = make_policy(schema, name="other_purge", chunk_rows=5000, ledger_keep_days=40)
    old, touched = (plan_run(conn, policy, CUTOFF - timedelta(hours=h)) for h in (2, 1))
    others = [plan_run(conn, other, CUTOFF - timedelta(hours=h)) for h in (2, 1)]
    assert all(p.chunks for p in (old, touched, *others))
    ledger = f'"{policy.ledger_schema}"'
    # All planned 45 days ago; one of the policy's runs completed yesterday (last touched then: kept).
    rows(admin, f"UPDATE {ledger}.runs SET planned_at = now() - interval '45 days'")
    rows(
        admin,
        f"UPDATE {ledger}.runs SET state = 'complete', completed_at = now() - interval '1 day' WHERE run_key = %(k)s",
        {"k": touched.run_key},
    )
    before = {r[0] for r in rows(admin, f"SELECT run_key FROM {ledger}.runs")}
    assert len(before) == 4
    again = plan_run(conn, policy, CUTOFF - timedelta(hours=1))  # a stored plan: returned, nothing pruned
    assert again.reused
    assert {r[0] for r in rows(admin, f"SELECT run_key FROM {ledger}.runs")} == before
    plan = plan_run(conn, policy, CUTOFF)  # plans a new run, then prunes
    after = {r[0] for r in rows(admin, f"SELECT run_key FROM {ledger}.runs")}
    assert before - after == {old.run_key}
    assert after == (before - {old.run_key}) | {plan.run_key}
    assert {p.run_key for p in others} <= after  # another policy's runs stay, however old
    assert ledger_chunks(admin, policy.ledger_schema, old.run_key) == []  # its chunks went with it
    assert len(ledger_chunks(admin, policy.ledger_schema, touched.run_key)) == len(touched.chunks)


def test_interleaved_tenants_are_warned_about_and_clustered_ones_are_not(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from airflow_retention.core.planner import warn_interleaved_tenants

    interleaved = create_events(admin, schema, "interleaved")
    fill_events(admin, interleaved, 20_000, tenant="mod(g, 10)")
    clustered = create_events(admin, schema, "clustered")
    fill_events(admin, clustered, 20_000, tenant="g / 2000")
    for table in ("interleaved", "clustered"):
        caplog.clear()
        policy = make_policy(schema, table=f"{schema}.{table}", tenant_column="tenant_id")
        with caplog.at_level("WARNING", logger="airflow_retention.core.planner"):
            plan = compute_plan(conn, policy, CUTOFF)
        assert len({c.tenants for c in plan.chunks}) >= 1
        warned = [r.getMessage() for r in caplog.records if "interleaved" in r.getMessage()]
        correlation = warn_interleaved_tenants(conn, policy)
        assert correlation is not None
        if table == "interleaved":
            assert abs(correlation) < 0.5 and warned and "chunk_by 'block'" in warned[0]
        else:
            assert abs(correlation) > 0.9 and not warned
