"""A partition chunk re-checks its action when it runs (issue 21, defects 3, 5 and 7): against the policy as it
is now and the partition's bound read from the catalog, never on the plan's word alone; a partition detached
by someone else after a failed detach is never dropped; a tenant policy's dropped partition is counted per
tenant. On both drivers, against the real PostgreSQL."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.conftest import connect
from tests.core.helpers import CUTOFF, ledger_chunk, make_policy, rows, scalar
from tests.core.partition_helpers import create_monthly, partitions_of, relations_in

CONDITION = "status <> 'open'"


def drop_policy(schema: str, **overrides: Any) -> Any:
    data = {"chunk_by": "block", "key_column": None, "condition": None, "expired_partitions": "drop", **overrides}
    return make_policy(schema, **data)


def oid_of(admin: Any, schema: str, name: str) -> int:
    return int(scalar(admin, f'SELECT \'"{schema}"."{name}"\'::regclass::oid::bigint'))


def lone_drop(admin: Any, schema: str, name: str, action: str = "drop") -> ChunkSpec:
    """A chunk written by hand, as a lone RetentionChunkOperator(action=..., partition=...) builds it."""
    return ChunkSpec(
        key=f"{action}:{schema}.{name}",
        lo=0,
        hi=1,
        partition=f"{schema}.{name}",
        partition_oid=oid_of(admin, schema, name),
        action=action,
    )


@pytest.mark.parametrize("condition", [None, CONDITION], ids=["concurrent", "atomic"])
def test_a_lone_drop_of_a_partition_not_wholly_expired_keeps_it(
    schema: str, conn: Any, admin: Any, condition: str | None
) -> None:
    create_monthly(admin, schema, status="'closed'")
    policy = drop_policy(schema, condition=condition)
    for month in ("m07", "m06"):  # newer than the cutoff; straddling it
        before = scalar(admin, f'SELECT count(*) FROM "{schema}".{month}')
        result = run_chunk(conn, policy, CUTOFF, lone_drop(admin, schema, month), lone=True)
        assert (result.outcome, result.rows_deleted) == ("kept", 0)
        assert f"{schema}.{month}" in partitions_of(admin, f'"{schema}".events')
        assert scalar(admin, f'SELECT count(*) FROM "{schema}".{month}') == before > 0
    # The same lone chunk on a wholly expired month does what it says.
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    result = run_chunk(conn, policy, CUTOFF, lone_drop(admin, schema, "m01"), lone=True)
    assert (result.outcome, result.rows_deleted) == ("dropped", january)
    assert "m01" not in relations_in(admin, schema)


@pytest.mark.parametrize("condition", [None, CONDITION], ids=["concurrent", "atomic"])
def test_a_policy_switched_to_delete_before_the_chunk_keeps_the_partition(
    schema: str, conn: Any, admin: Any, condition: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    create_monthly(admin, schema, status="'closed'")
    planned = drop_policy(schema, condition=condition)
    plan = plan_run(conn, planned, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    # A legal hold: the policy now deletes row by row, and the plan's drop must not run.
    hold = drop_policy(schema, condition=condition, expired_partitions="delete")
    with caplog.at_level(logging.WARNING, logger="airflow_retention"):
        result = run_chunk(conn, hold, plan.cutoff, chunk)
    assert (result.outcome, result.rows_deleted) == ("kept", 0)
    assert f"{schema}.m01" in partitions_of(admin, f'"{schema}".events')
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january
    assert "expired_partitions is 'delete' now" in caplog.text
    row = ledger_chunk(admin, planned.ledger_schema, plan.run_key, chunk.key)
    assert (row["state"], row["outcome"], row["rows_deleted"]) == ("complete", "kept", 0)


@pytest.mark.parametrize("condition", [None, CONDITION], ids=["concurrent", "atomic"])
def test_a_policy_switched_from_drop_to_detach_detaches_and_never_drops(
    schema: str, conn: Any, admin: Any, condition: str | None
) -> None:
    create_monthly(admin, schema, status="'closed'")
    plan = plan_run(conn, drop_policy(schema, condition=condition), CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    result = run_chunk(conn, drop_policy(schema, condition=condition, expired_partitions="detach"), plan.cutoff, chunk)
    assert (result.outcome, result.rows_deleted) == ("detached", january)
    assert f"{schema}.m01" not in partitions_of(admin, f'"{schema}".events')
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january  # kept as a table of its own


class _Crash(Exception):
    pass


def test_a_retry_after_the_detach_keeps_the_table_when_the_policy_no_longer_drops(
    schema: str, conn: Any, admin: Any
) -> None:
    create_monthly(admin, schema)
    policy = drop_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')

    def crash(step: str) -> None:
        if step == "after_detach":
            raise _Crash(step)

    with pytest.raises(_Crash):
        run_chunk(conn, policy, plan.cutoff, chunk, on_step=crash)
    assert f"{schema}.m01" not in partitions_of(admin, f'"{schema}".events')
    result = run_chunk(conn, drop_policy(schema, expired_partitions="delete"), plan.cutoff, chunk)
    assert (result.outcome, result.rows_deleted) == ("kept", 0)
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january


def test_a_partition_reattached_with_a_newer_bound_is_kept(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    policy = drop_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m05")
    # Partition maintenance after planning: May's table now holds August's rows under August's bound.
    rows(admin, f'ALTER TABLE {table} DETACH PARTITION "{schema}".m05')
    rows(admin, f'TRUNCATE "{schema}".m05')
    rows(
        admin, f"ALTER TABLE {table} ATTACH PARTITION \"{schema}\".m05 FOR VALUES FROM ('2024-08-01') TO ('2024-09-01')"
    )
    rows(
        admin, f"INSERT INTO {table} SELECT g, 1, timestamptz '2024-08-02', 'closed', '' FROM generate_series(1, 50) g"
    )
    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert (result.outcome, result.rows_deleted) == ("kept", 0)
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m05') == 50


def test_a_partition_a_dba_detached_after_a_timed_out_detach_is_never_dropped(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table = create_monthly(admin, schema)
    policy = drop_policy(schema, lock_timeout="300ms")
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    # Another session holds the parent: DETACH … CONCURRENTLY gives up at lock_timeout in its first phase.
    holder = connect("psycopg2")
    try:
        with holder.cursor() as cur:
            cur.execute(f"LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE")
        with pytest.raises(RetryableError, match="lock timeout"):
            run_chunk(conn, policy, plan.cutoff, chunk)
    finally:
        holder.rollback()
        holder.close()
    assert f"{schema}.m01" in partitions_of(admin, table)
    # A DBA detaches it to keep it; the chunk's retry must leave it alone.
    rows(admin, f'ALTER TABLE {table} DETACH PARTITION "{schema}".m01')
    with caplog.at_level(logging.WARNING, logger="airflow_retention"):
        result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert (result.outcome, result.rows_deleted) == ("partition_gone", 0)
    assert "was detached by someone else" in caplog.text
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january
    # The timed-out detach claimed nothing: it never began.
    assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["action_started_at"] is None


@pytest.mark.parametrize("default", [False, True], ids=["condition", "default-partition"])
def test_a_tenant_policy_counts_a_dropped_partition_per_tenant(
    schema: str, conn: Any, admin: Any, default: bool
) -> None:
    create_monthly(admin, schema, default=default)
    policy = drop_policy(schema, tenant_column="tenant_id", condition=None)
    plan = plan_run(conn, policy, CUTOFF)
    actions = [c for c in plan.chunks if c.action]
    assert actions
    expected: dict[tuple[str, str], int] = {}
    for chunk in actions:
        name = str(chunk.partition).split(".", 1)[1]
        for tenant, n in rows(admin, f'SELECT tenant_id::text, count(*) FROM "{schema}".{name} GROUP BY 1'):
            expected[(chunk.key, tenant)] = int(n)
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    counted = {
        (c, t): int(n)
        for c, t, n in rows(
            admin,
            f'SELECT chunk_key, tenant, rows_deleted FROM "{policy.ledger_schema}".tenant_counts WHERE run_key = %(k)s',
            {"k": plan.run_key},
        )
    }
    assert {k: v for k, v in counted.items() if k[0] in {c.key for c in actions}} == expected
    # The docs' promise: per-tenant counts add up to every chunk's rows_deleted, partition chunks included.
    chunks = rows(
        admin,
        f'SELECT chunk_key, rows_deleted FROM "{policy.ledger_schema}".chunks WHERE run_key = %(k)s',
        {"k": plan.run_key},
    )
    for key, deleted in chunks:
        assert sum(n for (c, _), n in counted.items() if c == key) == deleted, key
    assert sum(r["rows_deleted"] for r in Ledger(policy.ledger_schema).tenant_counts(conn, plan.run_key)) == sum(
        d for _, d in chunks
    )


def test_a_dry_run_of_a_partition_chunk_counts_per_tenant_and_keeps_what_a_run_would_keep(
    schema: str, conn: Any, admin: Any
) -> None:
    create_monthly(admin, schema)
    policy = drop_policy(schema, tenant_column="tenant_id", dry_run=True)
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert result.rows_matched == scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    matched = scalar(
        admin,
        f'SELECT sum(rows_matched)::bigint FROM "{policy.ledger_schema}".tenant_counts WHERE chunk_key = %(c)s',
        {"c": chunk.key},
    )
    assert matched == result.rows_matched
    lone = run_chunk(conn, policy, CUTOFF, lone_drop(admin, schema, "m07"), lone=True)
    assert (lone.outcome, lone.rows_matched) == ("kept", 0)
    assert len(relations_in(admin, schema)) == 8


@pytest.mark.parametrize(
    ("planned", "now", "cap", "expected"),
    [
        ("drop", "drop", None, "drop"),
        ("drop", "detach", None, "detach"),
        ("detach", "drop", None, "detach"),  # never more than the plan
        ("detach", "detach", None, "detach"),
        ("drop", "delete", None, None),
        ("detach", "delete", None, None),
        ("drop", "drop", 1_000, None),  # a tenant cap counts rows: partitions go row by row
    ],
)
def test_a_partition_chunk_does_no_more_than_both_its_plan_and_the_policy_now_allow(
    planned: str, now: str, cap: int | None, expected: str | None
) -> None:
    from airflow_retention.core.running.partition_checks import wanted_action

    extra = {"tenant_column": "tenant_id", "max_rows_per_tenant": cap} if cap else {}
    policy = drop_policy("s", expired_partitions=now, **extra)
    action, why = wanted_action(policy, planned)
    assert action == expected
    assert bool(why) == (action != planned)


def test_a_lone_block_range_on_a_partitioned_table_without_a_leaf_is_refused(
    schema: str, conn: Any, admin: Any
) -> None:
    """The parent of a partitioned table has no blocks of its own: a lone blocks=(lo, hi) on it would
    succeed with 0 rows. It is refused, naming the fix, before any ledger row is written."""
    create_monthly(admin, schema)
    policy = drop_policy(schema, expired_partitions="delete")
    before = scalar(admin, f'SELECT count(*) FROM "{schema}".events')
    with pytest.raises(PermanentError, match="partitioned table, which has no blocks of its own"):
        run_chunk(conn, policy, CUTOFF, ChunkSpec(key="blocks:0-1000", lo=0, hi=1000), lone=True)
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".events') == before > 0
    assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == 0
    # The same range on a leaf purges that leaf's eligible rows.
    leaf = ChunkSpec(
        key=f"blocks:0-1000:{schema}.m01",
        lo=0,
        hi=1000,
        partition=f"{schema}.m01",
        partition_oid=oid_of(admin, schema, "m01"),
    )
    result = run_chunk(conn, policy, CUTOFF, leaf, lone=True)
    assert result.rows_deleted > 0


def test_the_atomic_detach_lets_readers_through_while_it_checks_the_rows(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    """With a condition the chunk proves every row of the partition eligible under lock before its plain
    DETACH: a scan of the whole partition. Writers must wait for it, readers must not: only the DETACH
    itself holds ACCESS EXCLUSIVE on the parent (milliseconds)."""
    create_monthly(admin, schema, status="'closed'")
    policy = drop_policy(schema, condition=CONDITION)
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    seen: dict[str, Any] = {}

    def probe(step: str) -> None:
        if step != "before_detach":  # the rows are proved, the locks of the proof held
            return
        other = connect(driver)
        try:
            with other.cursor() as cur:
                cur.execute("SET lock_timeout = '1s'")
                cur.execute(f'SELECT count(*) FROM "{schema}".events')
                seen["read"] = cur.fetchone()[0]
            other.rollback()
            with other.cursor() as cur:
                cur.execute("SET lock_timeout = '200ms'")
                try:
                    cur.execute(f"UPDATE \"{schema}\".events SET status = 'closed' WHERE id = -1")
                    seen["write"] = "went through"
                except Exception as exc:  # noqa: BLE001 - the lock timeout is what the test expects
                    seen["write"] = type(exc).__name__ + ": " + str(exc).splitlines()[0]
            other.rollback()
        finally:
            other.close()

    result = run_chunk(conn, policy, plan.cutoff, chunk, on_step=probe)
    assert result.outcome == "dropped"
    assert seen["read"] == scalar(admin, f'SELECT count(*) FROM "{schema}".events') + result.rows_deleted
    assert "lock timeout" in seen["write"], seen
