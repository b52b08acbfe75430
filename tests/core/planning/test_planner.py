"""The planner on the real PostgreSQL (both drivers): deterministic, bounded chunks covering every
eligible row exactly once, planned once per run."""

from __future__ import annotations

import itertools
import logging
import threading
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec, MeasuredRate
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.planning.planner import compute_plan, plan_run
from airflow_retention.core.planning.plans import Plan, Preview
from airflow_retention.core.planning.sizing import ASSUMED_BLOCKS_PER_S, ASSUMED_ROWS_PER_S, size_chunks
from airflow_retention.core.planning.walkers.keys import MAX_TENANTS_PER_CHUNK
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from tests.conftest import connect
from tests.core.helpers import (
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
    with caplog.at_level(logging.WARNING, logger="airflow_retention.core.planning"):
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
    from airflow_retention.core.planning.probes import warn_interleaved_tenants

    interleaved = create_events(admin, schema, "interleaved")
    fill_events(admin, interleaved, 20_000, tenant="mod(g, 10)")
    clustered = create_events(admin, schema, "clustered")
    fill_events(admin, clustered, 20_000, tenant="g / 2000")
    for table in ("interleaved", "clustered"):
        caplog.clear()
        policy = make_policy(schema, table=f"{schema}.{table}", tenant_column="tenant_id")
        with caplog.at_level("WARNING", logger="airflow_retention.core.planning"):
            plan = compute_plan(conn, policy, CUTOFF)
        assert len({c.tenants for c in plan.chunks}) >= 1
        warned = [r.getMessage() for r in caplog.records if "interleaved" in r.getMessage()]
        correlation = warn_interleaved_tenants(conn, policy)
        assert correlation is not None
        if table == "interleaved":
            assert abs(correlation) < 0.5 and warned and "chunk_by 'block'" in warned[0]
        else:
            assert abs(correlation) > 0.9 and not warned


# -- chunks sized by time --------------------------------------------------------------------------


def _timed(**overrides: Any) -> RetentionPolicy:
    return make_policy("s", **{"chunk_rows": None, "batch_size": 1000, "max_active_chunks": 4, **overrides})


def test_without_history_a_small_purge_is_one_chunk_at_assumed_rates() -> None:
    sizing = size_chunks(_timed(chunk_by="block"), 500_000, 20_000, None, 1024)
    assert (sizing.chunks, sizing.measured_chunks) == (1, 0)
    assert sizing.rows_per_s == ASSUMED_ROWS_PER_S["block"] and sizing.blocks_per_s == ASSUMED_BLOCKS_PER_S
    assert sizing.seconds == pytest.approx(2.5)
    assert "assumed" in sizing.reason and "one chunk" in sizing.reason


def test_work_long_enough_to_share_gets_max_active_chunks() -> None:
    # 30 s of work: under one target chunk (45 s), but three chunks of 10 s for max_active_chunks 4.
    sizing = size_chunks(_timed(chunk_by="key"), 30 * ASSUMED_ROWS_PER_S["key"], None, None, 1024)
    assert (sizing.chunks, sizing.chunk_rows) == (3, 10 * ASSUMED_ROWS_PER_S["key"])
    assert "max_active_chunks 4 to share" in sizing.reason
    sizing = size_chunks(_timed(chunk_by="key"), 60 * ASSUMED_ROWS_PER_S["key"], None, None, 1024)
    assert sizing.chunks == 4  # two by time, four to share


def test_long_work_is_cut_by_target_chunk_time_up_to_max_chunks() -> None:
    rate = MeasuredRate(chunks=3, rows=3_000_000, blocks=None, seconds=30.0)  # 100,000 rows/s
    sizing = size_chunks(_timed(chunk_by="key", target_chunk_time="1 min"), 100_000_000, None, rate, 1024)
    assert (sizing.chunks, sizing.rows_per_s, sizing.measured_chunks) == (17, 100_000, 3)  # 1,000 s / 60 s
    assert sizing.chunk_rows == -(-100_000_000 // 17)
    assert "measured over 3 chunk(s)" in sizing.reason
    capped = size_chunks(_timed(chunk_by="key", target_chunk_time="1s"), 100_000_000, None, rate, 16)
    assert capped.chunks == 16 and "max_map_length 16" in capped.reason


def test_blocks_bound_the_estimate_when_the_rows_are_fewer_than_measured() -> None:
    # Measured on chunks that deleted 1,000,000 rows over 100,000 blocks in 10 s; now 10,000 rows over
    # 400,000 blocks: the blocks say 40 s (rows alone would say 0.1 s).
    rate = MeasuredRate(chunks=2, rows=1_000_000, blocks=100_000, seconds=10.0)
    sizing = size_chunks(_timed(chunk_by="block"), 10_000, 400_000, rate, 1024)
    assert sizing.seconds == pytest.approx(40.0)
    assert sizing.chunks == 4


def test_explicit_chunk_rows_overrides_the_time() -> None:
    sizing = size_chunks(_timed(chunk_rows=250_000), 1_000_000, None, None, 1024)
    assert (sizing.chunks, sizing.chunk_rows) == (4, 250_000)
    assert "chunk_rows 250,000 set in the policy" in sizing.reason


def test_chunk_count_follows_the_rate_measured_in_earlier_runs(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 5000)
    policy = make_policy(schema, chunk_rows=None, max_active_chunks=4)
    # No earlier run: assumed rates, and these few rows make one chunk.
    first = plan_run(conn, policy, CUTOFF - timedelta(days=1))
    assert first.sizing is not None and first.sizing.measured_chunks == 0
    assert len(first.chunks) == 1 and "assumed" in first.sizing.reason
    (chunk,) = first.chunks
    deleted = run_chunk(conn, policy, CUTOFF - timedelta(days=1), chunk).rows_deleted
    assert deleted > 1000
    # As if that chunk had taken 100 s from its first batch to its end.
    rows(
        admin,
        f"UPDATE \"{schema}_ledger\".chunks SET first_started_at = completed_at - interval '100 seconds'"
        " WHERE run_key = %(k)s",
        {"k": first.run_key},
    )
    second = plan_run(conn, policy, CUTOFF)
    sizing = second.sizing
    assert sizing is not None and sizing.measured_chunks == 1
    assert sizing.rows_per_s == pytest.approx(deleted / 100, rel=1e-3)
    assert sizing.seconds == pytest.approx(second.rows_planned / (deleted / 100), rel=1e-3)
    # 5000 rows hold about 1,540 eligible at the first cutoff and 1,030 more at the second: about 67 s
    # of work, two chunks by time, four to share among max_active_chunks.
    assert 45 < sizing.seconds < 90
    assert len(second.chunks) == sizing.chunks == 4
    assert all(c.rows_planned <= sizing.chunk_rows for c in second.chunks)
    assert ledger_run(admin, policy.ledger_schema, second.run_key)["chunk_rows"] == sizing.chunk_rows
    # A shorter target_chunk_time cuts the same work into more chunks (compute_plan reads the history too).
    preview = compute_plan(conn, make_policy(schema, chunk_rows=None, target_chunk_time="10s"), CUTOFF)
    assert preview.sizing is not None and len(preview.chunks) == preview.sizing.chunks == 7
    # A dry run is measured on dry runs only: none yet.
    dry = compute_plan(conn, make_policy(schema, chunk_rows=None, dry_run=True), CUTOFF)
    assert dry.sizing is not None and dry.sizing.measured_chunks == 0
    # The database budget's pauses and rests are not the chunk's work: 60 of its 100 s held at the floor
    # measure the rate of the other 40 (not a rate 2.5 times too low, and 2.5 times the chunks).
    rows(
        admin,
        f'UPDATE "{schema}_ledger".chunks SET paused = \'{{"wal_rate": 45.5, "slots": 14.5}}\'::jsonb'
        " WHERE run_key = %(k)s",
        {"k": first.run_key},
    )
    held = compute_plan(conn, make_policy(schema, chunk_rows=None, target_chunk_time="10s"), CUTOFF)
    assert held.sizing is not None and held.sizing.measured_chunks == 1
    assert held.sizing.rows_per_s == pytest.approx(deleted / 40, rel=1e-3)
    assert len(held.chunks) == held.sizing.chunks < len(preview.chunks)


def test_block_plan_reads_its_history_of_block_chunks(schema: str, conn: Any, admin: Any) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 5000)
    rows(admin, f"ANALYZE {table}")
    policy = make_policy(schema, chunk_rows=None, chunk_by="block")
    first = plan_run(conn, policy, CUTOFF - timedelta(days=1))
    for chunk in first.chunks:
        run_chunk(conn, policy, CUTOFF - timedelta(days=1), chunk)
    rows(
        admin,
        f"UPDATE \"{schema}_ledger\".chunks SET first_started_at = completed_at - interval '20 seconds'"
        " WHERE run_key = %(k)s",
        {"k": first.run_key},
    )
    blocks = int(scalar(admin, f"SELECT relpages FROM pg_class WHERE oid = '{table}'::regclass"))
    preview = compute_plan(conn, policy, CUTOFF)
    sizing = preview.sizing
    assert sizing is not None and sizing.measured_chunks == len(first.chunks)
    assert sizing.blocks is not None and sizing.blocks_per_s is not None
    assert sizing.blocks_per_s == pytest.approx(sum(c.hi - c.lo for c in first.chunks) / (20 * len(first.chunks)))
    assert blocks > 0 and sizing.seconds >= sizing.blocks / sizing.blocks_per_s - 1e-9
    # A key-range history is not a block one: a key policy of the same name sees none.
    key = compute_plan(conn, make_policy(schema, chunk_rows=None), CUTOFF)
    assert key.sizing is not None and key.sizing.measured_chunks == 0


# Run dates where rebuilding the date from the cutoff (cutoff + retention) goes wrong: month ends of a
# month-based retention, a leap day with "1 year", and a schedule in Europe/Paris the day after its
# clocks went forward. Each tenant's cutoff is the run's own date minus the tenant's retention, in UTC.
RUN_DATES = [
    pytest.param(
        datetime(2026, 3, 31, tzinfo=timezone.utc),
        "1 month",
        {"1": "2026-03-24T00:00:00+00:00", "2": "2026-03-21T00:00:00+00:00", "3": "2025-12-31T00:00:00+00:00"},
        id="month-end",
    ),
    pytest.param(
        datetime(2024, 2, 29, tzinfo=timezone.utc),
        "1 year",
        {"1": "2024-02-22T00:00:00+00:00", "2": "2024-02-19T00:00:00+00:00", "3": "2023-11-29T00:00:00+00:00"},
        id="leap-day",
    ),
    pytest.param(
        datetime(2026, 3, 30, tzinfo=ZoneInfo("Europe/Paris")),  # 2026-03-29T22:00Z: UTC+2 since that night
        "1 month",
        {"1": "2026-03-22T22:00:00+00:00", "2": "2026-03-19T22:00:00+00:00", "3": "2025-12-29T22:00:00+00:00"},
        id="dst",
    ),
]


@pytest.mark.parametrize(("run_date", "retention", "expected"), RUN_DATES)
def test_per_tenant_cutoffs_are_the_runs_own_date_minus_each_retention(
    schema: str, conn: Any, admin: Any, run_date: datetime, retention: str, expected: dict[str, str]
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 300, tenant="1 + mod(g, 3)")
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id integer, retention interval)')
    rows(admin, f"""INSERT INTO "{schema}".keep VALUES (2, '10 days'), (3, '3 months')""")
    policy = make_policy(
        schema,
        retention=retention,
        tenant_column="tenant_id",
        tenant_retention={1: "7 days"},
        tenant_retention_table=f"{schema}.keep",
    )
    cutoff = freeze_cutoff(policy, run_date)
    plan = plan_run(conn, policy, cutoff, run_date=run_date)
    frozen = {t: c for t, _, c, _ in Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)}
    assert {t: c.astimezone(timezone.utc).isoformat() for t, c in frozen.items()} == expected
    run = ledger_run(admin, policy.ledger_schema, plan.run_key)
    assert run is not None and run["run_date"] == run_date and run["cutoff"] == cutoff
    assert Ledger(policy.ledger_schema).get_run(conn, plan.run_key)["run_date"] == run_date


def test_a_cutoff_that_does_not_tell_its_run_date_is_refused_for_per_tenant_retention(
    schema: str, conn: Any, admin: Any
) -> None:
    """Runs of 2026-03-28 to 03-31 all freeze 02-28 with "1 month": given only that cutoff, the planner
    cannot freeze "7 days" from the run's date, and refuses rather than guess 03-28. A run date that
    is not the cutoff's is refused too; a retention in days tells the date back exactly."""
    table = create_events(admin, schema)
    fill_events(admin, table, 100)
    policy = make_policy(schema, retention="1 month", tenant_column="tenant_id", tenant_retention={1: "7 days"})
    cutoff = datetime(2026, 2, 28, tzinfo=timezone.utc)
    with pytest.raises(PermanentError, match="does not tell it") as info:
        plan_run(conn, policy, cutoff)
    assert "--date" in str(info.value)
    with pytest.raises(PermanentError, match="not the cutoff"):
        plan_run(conn, policy, cutoff, run_date=datetime(2026, 3, 27, tzinfo=timezone.utc))
    assert Ledger(policy.ledger_schema).get_run(conn, run_key(policy, cutoff)) is None
    days = make_policy(schema, retention="30 days", tenant_column="tenant_id", tenant_retention={1: "7 days"})
    plan = plan_run(conn, days, CUTOFF)
    assert Ledger(days.ledger_schema).tenant_cutoffs(conn, plan.run_key)[0][2] == CUTOFF + timedelta(days=23)
    assert ledger_run(admin, days.ledger_schema, plan.run_key)["run_date"] == CUTOFF + timedelta(days=30)
