"""Runs with nothing eligible (a backfilled day a later run already purged) plan no chunk, proven by one
exact probe through an index on the timestamp column, on the real PostgreSQL and both drivers; without
such an index, or when the probe cannot tell quickly, the run is planned as before."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import compute_plan, plan_run
from airflow_retention.core.planning.plans import Plan
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import verify_run
from tests.core.helpers import CUTOFF, create_events, eligible_ids, fill_events, ledger_run, make_policy, rows, scalar
from tests.core.partition_helpers import create_monthly, eligible_count
from tests.core.tenant_helpers import ANCHOR

# 100 days of rows, the last 10 after CUTOFF; every 7th row 'open' (kept by the condition).
DAYS = "%(cutoff)s::timestamptz + (mod(g * 37, 100) - 90) * interval '1 day' + interval '1 minute'"
SHAPES = {
    "block": {"chunk_by": "block", "key_column": None},
    "key": {},
    "block-tenants": {"chunk_by": "block", "tenant_column": "tenant_id"},
    "key-tenants": {"tenant_column": "tenant_id"},
}
INDEX = "events_created_at_idx"
# The planner and its walkers log under the planning package.
PLANNER = "airflow_retention.core.planning"


def purge(conn: Any, policy: RetentionPolicy, cutoff: datetime, run_date: datetime | None = None) -> Plan:
    """Plan and run every chunk, as the DAG does, and check the run verifies."""
    plan = plan_run(conn, policy, cutoff, run_date=run_date)
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok
    return plan


def events(admin: Any, schema: str, **create: Any) -> str:
    table = create_events(admin, schema, **create)
    fill_events(admin, table, 6_000, tenant="1 + mod(g, 4)", created=DAYS)
    return table


def assert_empty_run(admin: Any, policy: RetentionPolicy, plan: Plan, reason: str) -> None:
    assert (plan.chunks, plan.rows_planned, plan.reused) == ([], 0, False)
    assert plan.sizing is not None and (plan.sizing.chunks, plan.sizing.rows) == (0, 0)
    assert plan.sizing.reason == reason
    assert plan.sizing.to_dict()["reason"] == reason  # the plan task's XCom
    run = ledger_run(admin, policy.ledger_schema, plan.run_key)
    assert run is not None
    assert (run["state"], run["chunks_expected"], run["rows_deleted"]) == ("complete", 0, 0)
    assert verify_run(admin, Ledger(policy.ledger_schema), plan.run_key, []).ok


@pytest.mark.parametrize("shape", SHAPES)
def test_backfills_after_a_later_run_plan_no_chunk_and_say_why(
    schema: str, conn: Any, admin: Any, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    table = events(admin, schema)
    policy = make_policy(schema, **SHAPES[shape])
    assert purge(conn, policy, CUTOFF).chunks
    assert eligible_ids(admin, table) == []
    left = scalar(admin, f"SELECT count(*) FROM {table}")
    reason = (
        f"nothing eligible: no row of {schema}.events before the cutoff that the condition selects"
        f" through index {INDEX}: 0 chunks"
    )
    for days in (1, 7, 30):
        cutoff = CUTOFF - timedelta(days=days)
        assert compute_plan(conn, policy, cutoff).chunks == []  # the CLI's plan, which writes nothing
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=PLANNER):
            plan = plan_run(conn, policy, cutoff)
        assert_empty_run(admin, policy, plan, reason)
        assert any(reason.removesuffix(": 0 chunks") in r.getMessage() for r in caplog.records)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == left


@pytest.mark.parametrize("shape", SHAPES)
def test_eligible_rows_hidden_among_kept_ones_are_found(schema: str, conn: Any, admin: Any, shape: str) -> None:
    table = events(admin, schema)
    policy = make_policy(schema, **SHAPES[shape])
    purge(conn, policy, CUTOFF)
    # Every row before the backfill's cutoff is one the condition keeps, but for three that arrived late.
    kept = scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at < %(c)s", {"c": CUTOFF - timedelta(days=7)})
    assert kept > 500
    late = [100_001, 100_002, 100_003]
    rows(
        admin,
        f"INSERT INTO {table} (id, tenant_id, created_at, status)"
        " SELECT g, 2, %(c)s::timestamptz - (g - 100000) * interval '17 days', 'closed'"
        " FROM generate_series(100001, 100003) g",
        {"c": CUTOFF},
    )
    backfill = CUTOFF - timedelta(days=7)
    assert eligible_ids(admin, table, backfill) == late
    plan = purge(conn, policy, backfill)
    assert plan.chunks and not plan.sizing.reason.startswith("nothing eligible")
    assert eligible_ids(admin, table, backfill) == []
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at < %(c)s", {"c": backfill}) == kept


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_per_tenant_cutoffs_bound_the_probe(schema: str, conn: Any, admin: Any, chunk_by: str) -> None:
    """Tenant 1 keeps 60 days, tenant 2 only 10, the others 30 (the run's cutoff): the probe looks as far
    as the latest cutoff (tenant 2's) and honours each tenant's own."""
    table = events(admin, schema)
    policy = make_policy(
        schema, chunk_by=chunk_by, tenant_column="tenant_id", tenant_retention={1: "60 days", 2: "10 days"}
    )
    assert freeze_cutoff(policy, ANCHOR) == CUTOFF
    purge(conn, policy, CUTOFF, ANCHOR)
    reason = (
        f"nothing eligible: no row of {schema}.events before its tenant's cutoff that the condition selects"
        f" through index {INDEX}: 0 chunks"
    )

    def backfill(days: int) -> Plan:
        run_date = ANCHOR - timedelta(days=days)
        return purge(conn, policy, freeze_cutoff(policy, run_date), run_date)

    assert_empty_run(admin, policy, backfill(3), reason)
    # A row of tenant 1 older than the run's cutoff but within its own 60 days: never eligible here.
    insert = f"INSERT INTO {table} (id, tenant_id, created_at, status) VALUES (%(id)s, %(t)s, %(at)s, 'closed')"
    rows(admin, insert, {"id": 200_001, "t": 1, "at": ANCHOR - timedelta(days=45)})
    assert_empty_run(admin, policy, backfill(4), reason)
    # A row of tenant 2 past its own 10 days yet newer than the run's cutoff: eligible, and found.
    rows(admin, insert, {"id": 200_002, "t": 2, "at": ANCHOR - timedelta(days=17)})
    plan = backfill(5)
    assert plan.chunks and plan.rows_planned >= 1
    present = rows(admin, f"SELECT id FROM {table} WHERE id > 200000 ORDER BY id")
    assert present == [(200_001,)]


def test_a_partitioned_table_with_an_index_on_every_leaf(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    policy = make_policy(schema, chunk_by="block", key_column=None, condition=None, batch_size=500, chunk_rows=1_000)
    assert purge(conn, policy, CUTOFF).chunks
    assert eligible_count(admin, table) == 0
    plan = purge(conn, policy, CUTOFF - timedelta(days=40))
    reason = (
        f"nothing eligible: no row of {schema}.events before the cutoff through the index on created_at of each"
        " of its 7 leaf partition(s): 0 chunks"
    )
    assert_empty_run(admin, policy, plan, reason)


def test_a_policy_that_drops_expired_partitions_still_drops_empty_ones(schema: str, conn: Any, admin: Any) -> None:
    """Nothing is eligible, yet an empty partition wholly expired is the policy's to drop: it is planned
    as before, not proven empty."""
    table = create_monthly(admin, schema)
    rows(admin, f"DELETE FROM {table} WHERE created_at < '2024-03-01'")
    policy = make_policy(
        schema, chunk_by="block", key_column=None, condition=None, chunk_rows=1_000, expired_partitions="drop"
    )
    plan = purge(conn, policy, datetime.fromisoformat("2024-03-01T00:00:00+00:00"))
    assert sorted(c.key for c in plan.chunks) == [f"drop:{schema}.m01", f"drop:{schema}.m02"]


@pytest.mark.parametrize(
    ("shape", "index"),
    [
        ("block", None),
        ("key", None),
        ("block", "(created_at) WHERE status <> 'open'"),  # partial: not every row is in it
        ("block", "(tenant_id, created_at)"),  # not led by the timestamp
    ],
)
def test_without_an_index_led_by_the_timestamp_a_run_is_planned_as_before(
    schema: str, conn: Any, admin: Any, shape: str, index: str | None
) -> None:
    table = events(admin, schema, ts_index=False)
    if index:
        rows(admin, f"CREATE INDEX ON {table} {index}")
    policy = make_policy(schema, **SHAPES[shape])
    purge(conn, policy, CUTOFF)
    plan = plan_run(conn, policy, CUTOFF - timedelta(days=7))
    assert plan.sizing is not None and not plan.sizing.reason.startswith("nothing eligible")
    if shape == "block":  # one chunk over every block, as a table without a usable index always had
        blocks = scalar(admin, f"SELECT pg_relation_size('{table}') / current_setting('block_size')::bigint")
        assert [(c.lo, c.hi) for c in plan.chunks] == [(0, blocks)]
    else:
        assert plan.chunks == []


def test_a_leaf_without_the_index_means_no_probe(schema: str, conn: Any, admin: Any) -> None:
    create_monthly(admin, schema)
    rows(admin, f'DROP INDEX "{schema}".events_created_at_idx')
    for month in ("m01", "m02", "m03", "m04", "m05", "m06"):  # not m07
        rows(admin, f'CREATE INDEX ON "{schema}"."{month}" (created_at)')
    policy = make_policy(schema, chunk_by="block", key_column=None, condition=None, chunk_rows=1_000)
    purge(conn, policy, CUTOFF)
    plan = plan_run(conn, policy, CUTOFF - timedelta(days=40))
    assert plan.chunks == []  # the survey finds nothing either, leaf by leaf
    assert plan.sizing is None


def test_a_probe_that_cannot_tell_quickly_plans_as_before(
    schema: str, conn: Any, admin: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from airflow_retention.core.planning import probes

    table = create_events(admin, schema)
    # 300 old rows the condition keeps, each costing the probe 2 ms to reject: 0.6 s against 20 ms.
    fill_events(admin, table, 300, created="%(cutoff)s::timestamptz - g * interval '1 hour'", status="'open'")
    monkeypatch.setattr(probes, "EMPTY_PROBE_TIMEOUT_MS", 20)
    policy = make_policy(
        schema, chunk_by="block", key_column=None, condition="status <> 'open' OR pg_sleep(0.002) IS NULL"
    )
    with caplog.at_level(logging.INFO, logger=PLANNER):
        plan = compute_plan(conn, policy, CUTOFF)
    assert any("took over 20 ms: planned as usual" in r.getMessage() for r in caplog.records)
    assert len(plan.chunks) == 1 and not plan.sizing.reason.startswith("nothing eligible")


def test_a_dry_run_policy_finds_what_it_only_counted(schema: str, conn: Any, admin: Any) -> None:
    table = events(admin, schema)
    policy = make_policy(schema, chunk_by="block", key_column=None, dry_run=True)
    purge(conn, policy, CUTOFF)
    assert eligible_ids(admin, table)  # a dry run deletes nothing
    plan = plan_run(conn, policy, CUTOFF - timedelta(days=7))
    assert plan.chunks and not plan.sizing.reason.startswith("nothing eligible")
