"""The cleanup SLO (core/running/slo.py) learnt from the ledger on the real PostgreSQL: from runs the real
engine purged (μ from the chunks' working time, c from the budget's own observations, the pauses per
reason), and from a recorded history the engine cannot produce quickly (days of runs, a budget held at its
floor), inserted into the ledger's tables directly."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.slo import cleanup_slo, lambda_per_day, schedule_interval
from airflow_retention.core.running.verify import measure_leftovers

from ..helpers import CUTOFF, FLOOR_DUTY, FLOOR_LEVEL, create_events, eligible_ids, fill_events, make_policy, rows

# c of the last run: at the floor 60 % of the time, one full batch 20 %, paused 20 %.
LAST_C = 0.6 * FLOOR_DUTY + 0.2

DAY = timedelta(days=1)


def test_no_ledger_or_no_complete_run_has_no_slo(admin: Any, schema: str, conn: Any) -> None:
    policy = make_policy(schema, budget=True, chunk_rows=300)
    assert cleanup_slo(conn, policy) is None  # no ledger at all
    table = create_events(admin, schema)
    fill_events(admin, table, 600)
    plan = plan_run(conn, policy, CUTOFF)
    run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    assert cleanup_slo(conn, policy) is None  # planned, a chunk done, nothing complete to learn from


def test_runs_purged_by_the_engine_give_mu_c_lambda_and_the_pauses(admin: Any, schema: str, conn: Any) -> None:
    # A duty cycle of 5 %, below the budget's slow start (10 %, beside the other tests' sessions, where a slow
    # canary keeps it): the rests are recorded as paused (max_duty_cycle) and left out of μ.
    policy = make_policy(schema, budget=True, chunk_rows=300, max_duty_cycle=0.05)
    table = create_events(admin, schema)
    fill_events(admin, table, 2000)
    eligible = len(eligible_ids(admin, table))
    ledger = Ledger(policy.ledger_schema)
    plan = plan_run(conn, policy, CUTOFF)
    for chunk in plan.chunks:
        run_chunk(conn, policy, CUTOFF, chunk)
    ledger.complete_run(conn, plan.run_key, "test")
    measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=plan.run_key)

    slo = cleanup_slo(conn, policy)
    assert slo is not None
    chunks = ledger.chunk_rows(conn, plan.run_key)
    # μ: the chunks' rows over their working time, computed here from the chunk rows themselves.
    worked = sum(
        (c["completed_at"] - c["first_started_at"]).total_seconds() - c["backoff_seconds"] - sum(c["paused"].values())
        for c in chunks
    )
    paused: dict[str, float] = {}
    for c in chunks:
        for reason, seconds in c["paused"].items():
            paused[reason] = paused.get(reason, 0.0) + seconds
    assert paused.get("max_duty_cycle", 0) > 0, paused
    assert slo.paused_seconds == pytest.approx(paused, abs=1e-3)
    assert slo.mu_rows_per_s == pytest.approx(eligible / worked, rel=1e-3)
    # One run of a daily policy: λ is its rows over one day; nothing left, so the backlog is 0.
    assert (slo.runs, slo.last_run_key, slo.backlog_rows) == (1, plan.run_key, 0)
    assert slo.lambda_rows_per_day == pytest.approx(eligible)
    assert slo.window_s == 86_400
    # c: the budget's own observations over the run, each held until the next, the duty capped at the policy's.
    first = min(c["first_started_at"] for c in chunks)
    last = max(c["completed_at"] for c in chunks)
    # The observation in force at the first batch (the budget is observed before it) counts from there.
    recorded = ledger.observations(conn, first - timedelta(hours=1), last)
    before = [o for o in recorded if o["at"] <= first][-1:]
    seen = [{**o, "at": first} for o in before] + [o for o in recorded if o["at"] > first]
    assert seen, "the budget observed nothing before or during the run"
    assert slo.observations == len(seen)
    ends = [o["at"] for o in seen[1:]] + [last]
    held = [(end - o["at"]).total_seconds() for o, end in zip(seen, ends, strict=True)]
    shares = [0.0 if o["paused"] else o["concurrency"] * min(o["duty"], policy.max_duty_cycle) for o in seen]
    expected_c = (
        sum(s * h for s, h in zip(shares, held, strict=True)) / sum(held)
        if sum(held) > 0
        else sum(shares) / len(shares)
    )
    assert slo.concurrency == pytest.approx(expected_c, rel=1e-6)
    assert slo.concurrency <= policy.max_duty_cycle + 1e-12  # a weighted mean of shares at the cap
    assert slo.capacity_rows == pytest.approx(slo.concurrency * slo.mu_rows_per_s * 86_400)
    assert slo.needed_rows == pytest.approx(eligible)
    assert slo.keeps_up is True and slo.warnings == []
    assert "cleanup SLO: λ" in slo.describe() and "keeps up" in slo.describe()
    data = slo.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["keeps_up"] is True and data["paused_seconds"] == slo.paused_seconds


def _history(admin: Any, ledger_schema: str, now: datetime) -> None:
    """Three daily runs of ``slo_events`` (5M, 10M, 14M rows; the last left 100,000 eligible), each one chunk
    whose working time is 10,000 (after a throttle's 500 s), 20,000 and 28,000 s (μ = 500 rows/s); the last
    run's chunk paused 600 s for the canary and 120 s for slots, and the budget's observations over it: at
    its floor (one batch at the default min_duty) 60 % of the time, one full batch 20 %, paused 20 % (LAST_C). Plus what
    must not count: another policy's run, a lone run and a dry run of the policy, and observations before
    and after the run."""
    s = f'"{ledger_schema}"'
    last_start = now - timedelta(hours=9)
    span = 28_720.0
    runs = [
        ("slo_events@d1", now - 2 * DAY, 5_000_000, None, now - 2 * DAY, 10_000, 500.0, {}),
        ("slo_events@d2", now - DAY, 10_000_000, None, now - DAY, 20_000, 0.0, {}),
        ("slo_events@d3", now, 14_000_000, 100_000, last_start, 28_000, 0.0, {"canary_latency": 600, "slots": 120}),
        ("slo_events@d3#lone", now, 90_000_000, None, last_start, 10, 0.0, {}),
        ("slo_events@d3#dry-run", now, 90_000_000, None, last_start, 10, 0.0, {}),
        ("other@d4", now + DAY, 90_000_000, 5, now, 10, 0.0, {}),
    ]
    for key, date, n, left, started, seconds, backoff, paused in runs:
        policy = key.split("@")[0]
        dry = key.endswith("#dry-run")
        rows(
            admin,
            f"INSERT INTO {s}.runs (run_key, policy, target_table, cutoff, dry_run, state, chunk_rows, batch_size,"
            " chunks_expected, rows_planned, completed_at, chunks_completed, rows_deleted, rows_matched,"
            " eligible_left, run_date) VALUES (%(k)s, %(p)s, 't', %(d)s::timestamptz - interval '30 days',"
            " %(dry)s, 'complete', 1, 1, 1, %(n)s, %(done)s, 1, %(del)s, %(match)s, %(left)s, %(d)s)",
            {"k": key, "p": policy, "d": date, "dry": dry, "n": n, "del": 0 if dry else n, "match": n if dry else 0,
             "done": started + timedelta(seconds=seconds + backoff + sum(paused.values())), "left": left},
        )  # fmt: skip
        total = seconds + backoff + sum(paused.values())
        rows(
            admin,
            f"INSERT INTO {s}.chunks (run_key, chunk_key, lo, hi, state, next_key, rows_deleted, rows_matched,"
            " attempts, first_started_at, last_batch_at, completed_at, backoff_seconds, paused, batches)"
            " VALUES (%(k)s, 'all:0-10', 0, 10, 'complete', 10, %(del)s, %(match)s, 1, %(s)s, %(e)s, %(e)s, %(b)s,"
            " %(paused)s::jsonb, 1)",
            {"k": key, "del": 0 if dry else n, "match": n if dry else 0, "s": started,
             "e": started + timedelta(seconds=total), "b": backoff,
             "paused": json.dumps(paused)},
        )  # fmt: skip
    observations = [
        (-100, 8, 4, 1.0, False, []),  # before the run: not counted
        (0, FLOOR_LEVEL, 1, FLOOR_DUTY, False, ["canary_latency 9.0 ms > 4.0 ms (baseline 1.0 ms)"]),
        (0.6 * span, 5, 1, 1.0, False, []),
        (0.8 * span, 5, 1, 1.0, True, ["replica_lag 40000ms > 30000ms"]),
        (span + 100, 8, 4, 1.0, False, []),  # after it
    ]
    for offset, level, concurrency, duty, paused_, reasons in observations:
        rows(
            admin,
            f"INSERT INTO {s}.budget_observations (at, scope, level, concurrency, duty, paused, move, signals,"
            " reasons) VALUES (%(at)s, 'database', %(l)s, %(c)s, %(duty)s, %(p)s, 'hold', '{}', %(r)s::text[])",
            {"at": last_start + timedelta(seconds=offset), "l": level, "c": concurrency, "duty": duty,
             "p": paused_, "r": reasons},
        )  # fmt: skip


@pytest.fixture
def history(admin: Any, schema: str, conn: Any) -> datetime:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    Ledger(f"{schema}_ledger").ensure(conn)
    _history(admin, f"{schema}_ledger", now)
    return now


def test_a_recorded_history_that_cannot_keep_up_and_a_budget_at_its_floor_warn(
    schema: str, conn: Any, history: datetime
) -> None:
    policy = make_policy(schema, budget=True, name="slo_events")
    slo = cleanup_slo(conn, policy)
    assert slo is not None
    assert (slo.runs, slo.last_run_key) == (3, "slo_events@d3")
    # λ: the two later runs' rows over the two days from the first run's date to the last's.
    assert slo.lambda_rows_per_day == pytest.approx(12_000_000)
    assert slo.mu_rows_per_s == pytest.approx(500)
    assert slo.concurrency == pytest.approx(LAST_C)
    assert slo.backlog_rows == 100_000
    assert slo.capacity_rows == pytest.approx(LAST_C * 500 * 86_400)
    assert slo.needed_rows == pytest.approx(12_100_000)
    assert slo.keeps_up is False
    assert slo.observations == 3 and slo.floor_share == pytest.approx(2 / 3)
    assert slo.paused_seconds == {"canary_latency": 600.0, "slots": 120.0}
    assert slo.floor_reasons == ("canary_latency", "replica_lag", "slots")
    risk, exhausted = slo.warnings
    assert risk.startswith(
        f"cleanup SLO at risk: c*mu = {LAST_C * 500:.1f} rows/s cannot keep up with lambda 12,000,000 rows/day"
        " plus a backlog of 100,000 row(s) within the cleanup window 1 day"
    ), risk
    assert exhausted.startswith(
        "exhausted database budget: held at its floor for 67% of the last run (reasons: canary_latency (600 s"
        " paused), replica_lag, slots (120 s paused))"
    ), exhausted

    # The cleanup window is the policy's when it has one: a week holds 7 days of arrivals, still too many.
    weekly = cleanup_slo(conn, make_policy(schema, budget=True, name="slo_events", cleanup_window="7 days"))
    assert weekly is not None and weekly.window_s == 7 * 86_400
    assert weekly.needed_rows == pytest.approx(7 * 12_000_000 + 100_000) and weekly.keeps_up is False
    # A policy whose own duty cycle is below the budget's caps it: c = 0.6 x the floor (below it) + 0.2 x 0.05.
    halved = cleanup_slo(conn, make_policy(schema, budget=True, name="slo_events", max_duty_cycle=0.05))
    assert halved is not None and halved.concurrency == pytest.approx(0.6 * FLOOR_DUTY + 0.2 * 0.05)


def test_lambda_and_the_schedule_interval() -> None:
    class Run:
        def __init__(self, cutoff: datetime, rows: int, run_date: datetime | None) -> None:
            self.cutoff, self.rows, self.run_date = cutoff, rows, run_date

    day0 = datetime(2026, 3, 1, tzinfo=timezone.utc)
    dated = [Run(day0 + 2 * DAY, 300, day0 + 2 * DAY), Run(day0 + DAY, 100, day0 + DAY), Run(day0, 999, day0)]
    assert lambda_per_day(dated, DAY) == pytest.approx(200)
    # A run without a date: the cutoffs span the days instead.
    undated = [Run(day0 + 4 * DAY, 300, None), Run(day0, 999, day0 + 9 * DAY)]
    assert lambda_per_day(undated, DAY) == pytest.approx(75)
    # One run, or runs sharing one date: their rows over one interval each.
    assert lambda_per_day([Run(day0, 600, day0)], timedelta(hours=6)) == pytest.approx(2400)
    assert lambda_per_day([Run(day0, 600, day0), Run(day0, 200, day0)], DAY) == pytest.approx(400)
    assert schedule_interval("@daily") == DAY
    assert schedule_interval("@hourly") == timedelta(hours=1)
    assert schedule_interval("*/15 * * * *") == timedelta(minutes=15)
    assert schedule_interval(None) is None and schedule_interval("@once") is None


def test_a_ledger_older_than_the_budget_is_read_without_it(admin: Any, schema: str, conn: Any) -> None:
    """``status`` and the view read a ledger without migrating it: on version 7 (no budget tables, no
    ``chunks.paused``) the SLO is learnt from the runs and chunks alone, c is the policy's duty cycle."""
    from airflow_retention.core.ledger.schema import _MIGRATIONS

    ledger = Ledger(f"{schema}_ledger")
    s = ledger.s
    rows(admin, f"CREATE SCHEMA {s}")
    for step in range(1, 8):
        rows(admin, _MIGRATIONS[step].format(s=s))
    rows(
        admin,
        f"CREATE TABLE {s}.ledger_version (singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
        " version integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now())",
    )
    rows(admin, f"INSERT INTO {s}.ledger_version (version) VALUES (7)")
    rows(
        admin,
        f"INSERT INTO {s}.runs (run_key, policy, target_table, cutoff, state, chunk_rows, batch_size, chunks_expected,"
        " rows_planned, completed_at, rows_deleted, rows_matched, eligible_left) VALUES ('events_purge@v7',"
        " 'events_purge', 't', %(c)s, 'complete', 1, 1, 1, 3000, now(), 3000, 0, 7)",
        {"c": CUTOFF},
    )
    rows(
        admin,
        f"INSERT INTO {s}.chunks (run_key, chunk_key, lo, hi, state, next_key, rows_deleted, attempts,"
        " first_started_at, last_batch_at, completed_at, backoff_seconds) VALUES ('events_purge@v7', 'all:0-9', 0, 9,"
        " 'complete', 9, 3000, 1, now() - interval '12 seconds', now(), now(), 2)",
    )
    assert ledger.budget_snapshot(conn) is None
    assert ledger.paused_by_reason(conn, "events_purge@v7") == {}
    slo = cleanup_slo(conn, make_policy(schema, budget=True, max_duty_cycle=0.5), ledger)
    assert slo is not None and ledger.version(conn) == 7  # read, not migrated
    assert slo.mu_rows_per_s == pytest.approx(300, rel=1e-3)  # 3,000 rows over 12 s less 2 s of throttle
    assert (slo.concurrency, slo.observations, slo.paused_seconds, slo.backlog_rows) == (0.5, 0, {}, 7)
    assert slo.lambda_rows_per_day == pytest.approx(3000) and slo.keeps_up is True
