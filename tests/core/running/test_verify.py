"""verify_run against the ledger: what a run is missing, named."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import (
    LAG_AT_VERIFY_ROWS,
    lag_left_to_next_run,
    measure_leftovers,
    measure_pending_lag,
    verify_run,
)
from tests.core.helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows


def _planned(admin: Any, schema: str, conn: Any) -> tuple[Any, Any]:
    table = create_events(admin, schema)
    fill_events(admin, table, 2000)  # about 1,030 eligible rows
    policy = make_policy(schema, chunk_rows=300)
    plan = plan_run(conn, policy, CUTOFF)
    assert len(plan.chunks) == 4
    return policy, plan


def test_missing_pending_and_deleted_chunks_are_named(schema: str, conn: Any, admin: Any) -> None:
    policy, plan = _planned(admin, schema, conn)
    ledger = Ledger(policy.ledger_schema)
    keys = [c.key for c in plan.chunks]
    done = run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    rows(
        admin,
        f'DELETE FROM "{policy.ledger_schema}".chunks WHERE run_key = %(r)s AND chunk_key = %(c)s',
        {"r": plan.run_key, "c": keys[2]},
    )

    given = verify_run(conn, ledger, plan.run_key, keys)
    assert not given.ok
    assert (given.expected, given.complete) == (4, 1)
    assert given.missing == [keys[1], f"{keys[2]} (no ledger row)", keys[3]]
    assert given.rows_deleted == done.rows_deleted == 300
    assert keys[1] in given.describe()
    assert "1 of 4" in given.describe()

    own = verify_run(conn, ledger, plan.run_key)
    assert not own.ok
    assert own.missing == [keys[1], keys[3], "1 chunk row(s) deleted from the ledger"]


def test_chunk_marked_done_elsewhere_but_not_in_ledger_is_missing(schema: str, conn: Any, admin: Any) -> None:
    policy, plan = _planned(admin, schema, conn)
    for chunk in plan.chunks[:3]:
        run_chunk(conn, policy, CUTOFF, chunk)
    result = verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks])
    assert result.missing == [plan.chunks[3].key]
    run_chunk(conn, policy, CUTOFF, plan.chunks[3])
    result = verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks])
    assert result.ok
    assert result.complete == 4
    deleted = sum(c["rows_deleted"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key))
    assert result.rows_deleted == deleted == plan.rows_planned
    assert "all 4 expected chunk(s) complete" in result.describe()


def test_unknown_run(schema: str, conn: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    result = verify_run(conn, ledger, "nope@2024-01-01T00:00:00Z", ["a", "b"])
    assert not result.ok
    assert not result.run_found
    assert result.missing == ["a", "b"]
    assert "never planned" in result.describe()


def test_scheduled_anchors_follow_the_cron() -> None:
    from airflow_retention.core.running.verify import scheduled_anchors

    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    days = scheduled_anchors("@daily", start, datetime(2026, 3, 4, tzinfo=timezone.utc))
    assert [d.day for d in days] == [1, 2, 3, 4]
    assert scheduled_anchors("30 6 * * 1", start, datetime(2026, 3, 31, tzinfo=timezone.utc))[0] == datetime(
        2026, 3, 2, 6, 30, tzinfo=timezone.utc
    )
    assert scheduled_anchors(None, start, start) == scheduled_anchors("@once", start, start) == []


def test_missed_runs_are_the_days_without_a_complete_run_in_words(schema: str, conn: Any, admin: Any) -> None:
    from datetime import timedelta

    from airflow_retention.core.planning.cutoff import freeze_cutoff
    from airflow_retention.core.running.verify import missed_runs

    table = create_events(admin, schema)
    fill_events(admin, table, 500)
    policy = make_policy(schema, retention="1 day", schedule="@daily")
    anchor = datetime(2024, 6, 10, tzinfo=timezone.utc)
    days = [anchor + timedelta(days=i) for i in range(5)]  # the 10th .. the 14th
    for ran in (days[0], days[2], days[4]):
        plan = plan_run(conn, policy, freeze_cutoff(policy, ran))
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        verify_and_complete(conn, policy, plan)
    ledger = Ledger(policy.ledger_schema)
    missed = missed_runs(conn, ledger, policy, days[0], days[4])
    assert [m.anchor for m in missed] == [days[1], days[3]]
    text = missed[0].describe("retention_events_purge")
    assert text.startswith("no complete run for 2024-06-11T00:00:00Z (cutoff 2024-06-10T00:00:00Z)")
    assert "airflow backfill create --dag-id retention_events_purge --from-date 2024-06-11" in text
    # A backfill fills the gap.
    plan = plan_run(conn, policy, freeze_cutoff(policy, days[1]))
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    verify_and_complete(conn, policy, plan)
    assert [m.anchor for m in missed_runs(conn, ledger, policy, days[0], days[4])] == [days[3]]


def test_missed_days_split_what_a_backfill_could_purge_from_what_a_later_run_covered(
    schema: str, conn: Any, admin: Any
) -> None:
    """One definition for the verify log, the CLI and the view: the days of the window before ``until``
    without a complete run; those at or before the latest complete run's cutoff are covered (their run
    would find nothing it may delete), the others are missed."""
    from datetime import timedelta

    from airflow_retention.core.planning.cutoff import freeze_cutoff
    from airflow_retention.core.running.verify import MISSED_RUNS_WINDOW, missed_days

    table = create_events(admin, schema)
    fill_events(admin, table, 500)
    policy = make_policy(schema, retention="1 day", schedule="@daily", start_date="2024-01-01")
    anchor = datetime(2024, 6, 10, tzinfo=timezone.utc)
    days = [anchor + timedelta(days=i) for i in range(6)]  # the 10th .. the 15th
    for ran in (days[0], days[2]):
        plan = plan_run(conn, policy, freeze_cutoff(policy, ran))
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        verify_and_complete(conn, policy, plan)
    ledger = Ledger(policy.ledger_schema)

    found = missed_days(conn, ledger, policy, days[5])
    # Covered: the 11th, and the 25 days of the window before the 10th; each by the 12th's run.
    assert [m.anchor for m in found.covered][-1:] == [days[1]] and len(found.covered) == 26
    assert days[0] not in [m.anchor for m in found.covered]
    assert {m.covered_by for m in found.covered} == {freeze_cutoff(policy, days[2])}
    assert [m.anchor for m in found.missed] == [days[3], days[4]]  # until itself is left out
    # The window: 31 days back from until, exclusive at both ends.
    assert found.since == days[5] - MISSED_RUNS_WINDOW
    window = [m.anchor for m in found.covered + found.missed]
    assert min(window) > found.since
    older = missed_days(conn, ledger, policy, days[0])
    assert len(older.covered) == 30 and not older.missed  # the 30 days before the first run, all covered by it
    # A dry-run policy's runs delete nothing: nothing is covered.
    dry = make_policy(schema, retention="1 day", schedule="@daily", start_date="2024-01-01", dry_run=True)
    assert not missed_days(conn, ledger, dry, days[5]).covered


def verify_and_complete(conn: Any, policy: Any, plan: Any) -> None:
    ledger = Ledger(policy.ledger_schema)
    assert verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks]).ok
    ledger.complete_run(conn, plan.run_key, "test")


def test_scheduled_anchors_accept_pendulum_and_other_zones() -> None:
    import pendulum

    from airflow_retention.core.running.verify import scheduled_anchors

    start = pendulum.datetime(2026, 3, 1, 1, tz="Europe/Paris")  # 2026-03-01T00:00Z
    end = pendulum.datetime(2026, 3, 3, tz="UTC")
    days = scheduled_anchors("@daily", start, end)
    assert days == [datetime(2026, 3, d, tzinfo=timezone.utc) for d in (1, 2, 3)]


def _events(admin: Any, schema: str) -> tuple[str, Any, Ledger]:
    table = create_events(admin, schema)
    fill_events(admin, table, 2000)
    policy = make_policy(schema, chunk_rows=300)
    return table, policy, Ledger(policy.ledger_schema)


def _purged(conn: Any, policy: Any, cutoff: datetime) -> str:
    """Plan, purge and mark complete a run at ``cutoff``, as the DAG does; its lag is not measured."""
    plan = plan_run(conn, policy, cutoff)
    for chunk in plan.chunks:
        run_chunk(conn, policy, cutoff, chunk)
    Ledger(policy.ledger_schema).complete_run(conn, plan.run_key, "test")
    return plan.run_key


def _reopen(admin: Any, table: str, where: str, params: dict[str, Any]) -> tuple[int, datetime]:
    """Make one held-back ('open') row matching ``where`` eligible, as an application closing it after
    its chunk went by; returns its id and timestamp."""
    return rows(
        admin,
        f"UPDATE {table} SET status = 'closed' WHERE id = (SELECT min(id) FROM {table}"
        f" WHERE status = 'open' AND {where}) RETURNING id, created_at",
        params,
    )[0]


def test_the_lag_window_starts_where_the_previous_measured_run_left_off(schema: str, conn: Any, admin: Any) -> None:
    table, policy, ledger = _events(admin, schema)
    earlier = CUTOFF - timedelta(hours=10)

    first = _purged(conn, policy, earlier)
    measured = measure_leftovers(conn, policy, earlier, ledger=ledger, run_key=first, windowed=True)
    assert (measured.count, measured.since) == (0, None)  # no earlier measured run: from the oldest row

    second = _purged(conn, policy, CUTOFF)
    _, before_window = _reopen(admin, table, "created_at < %(c)s", {"c": earlier})
    _, in_window = _reopen(admin, table, "created_at >= %(c)s AND created_at < %(d)s", {"c": earlier, "d": CUTOFF})
    everything = measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=second, record=False)
    assert (everything.count, everything.oldest) == (2, before_window)
    windowed = measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=second, windowed=True)
    # A row older than the window was eligible at the first run's measurement: only a row made eligible
    # since (reopened) can be there, and the next run deletes it; the walk starts at the earlier cutoff.
    assert (windowed.count, windowed.oldest, windowed.since) == (1, in_window, earlier)
    assert "rows from" in windowed.describe(CUTOFF)
    recorded = ledger.get_run(conn, second)
    assert recorded is not None and (recorded["eligible_left"], recorded["oldest_eligible_at"]) == (1, in_window)

    # A measured run that left rows moves the window back to its oldest row left.
    later = CUTOFF + timedelta(hours=5)
    assert ledger.lag_window_start(conn, policy.name, False, "a later run", later) == in_window


def test_the_next_run_measures_the_lag_a_large_run_left_to_it(schema: str, conn: Any, admin: Any) -> None:
    table, policy, ledger = _events(admin, schema)
    earlier = CUTOFF - timedelta(hours=10)
    assert measure_pending_lag(conn, policy, ledger) is None  # no ledger yet

    first = _purged(conn, policy, earlier)
    run = ledger.get_run(conn, first)
    assert run is not None and run["lag_measured_at"] is None
    _, left = _reopen(admin, table, "created_at < %(c)s", {"c": earlier})

    found = measure_pending_lag(conn, policy, ledger)
    assert found is not None
    pending, leftovers = found
    assert pending["run_key"] == first
    assert (leftovers.count, leftovers.oldest, leftovers.since) == (1, left, None)
    run = ledger.get_run(conn, first)
    assert run is not None and run["lag_measured_at"] is not None and run["eligible_left"] == 1
    assert measure_pending_lag(conn, policy, ledger) is None  # measured once

    second = _purged(conn, policy, CUTOFF)
    found = measure_pending_lag(conn, policy, ledger)
    assert found is not None and found[0]["run_key"] == second
    assert (found[1].count, found[1].since) == (0, left)  # the first run's row left starts the window


def test_a_run_that_deleted_many_rows_leaves_its_lag_to_the_next_run() -> None:
    assert lag_left_to_next_run({"rows_deleted": LAG_AT_VERIFY_ROWS}) is None
    assert lag_left_to_next_run({"rows_deleted": None}) is None  # a dry run deletes nothing
    why = lag_left_to_next_run({"rows_deleted": LAG_AT_VERIFY_ROWS + 1})
    assert why is not None and f"{LAG_AT_VERIFY_ROWS + 1:,} rows" in why and "VACUUM" in why
