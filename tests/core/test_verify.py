"""verify_run against the ledger: what a run is missing, named."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow_retention.core.engine import run_chunk
from airflow_retention.core.ledger import Ledger
from airflow_retention.core.planner import plan_run
from airflow_retention.core.verify import verify_run

from .helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows


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
    from airflow_retention.core.verify import scheduled_anchors

    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    days = scheduled_anchors("@daily", start, datetime(2026, 3, 4, tzinfo=timezone.utc))
    assert [d.day for d in days] == [1, 2, 3, 4]
    assert scheduled_anchors("30 6 * * 1", start, datetime(2026, 3, 31, tzinfo=timezone.utc))[0] == datetime(
        2026, 3, 2, 6, 30, tzinfo=timezone.utc
    )
    assert scheduled_anchors(None, start, start) == scheduled_anchors("@once", start, start) == []


def test_missed_runs_are_the_days_without_a_complete_run_in_words(schema: str, conn: Any, admin: Any) -> None:
    from datetime import timedelta

    from airflow_retention.core.cutoff import freeze_cutoff
    from airflow_retention.core.verify import missed_runs

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


def verify_and_complete(conn: Any, policy: Any, plan: Any) -> None:
    ledger = Ledger(policy.ledger_schema)
    assert verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks]).ok
    ledger.complete_run(conn, plan.run_key, "test")


def test_scheduled_anchors_accept_pendulum_and_other_zones() -> None:
    import pendulum

    from airflow_retention.core.verify import scheduled_anchors

    start = pendulum.datetime(2026, 3, 1, 1, tz="Europe/Paris")  # 2026-03-01T00:00Z
    end = pendulum.datetime(2026, 3, 3, tz="UTC")
    days = scheduled_anchors("@daily", start, end)
    assert days == [datetime(2026, 3, d, tzinfo=timezone.utc) for d in (1, 2, 3)]
