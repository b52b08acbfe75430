"""Partitioned tables against the real PostgreSQL, on both drivers: block chunks per leaf, whole
expired partitions detached or dropped, partitions that change under a plan, and bad input."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError, PolicyError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import compute_plan, plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers, verify_run
from tests.core.helpers import CUTOFF, ledger_chunks, make_policy, rows, scalar
from tests.core.partition_helpers import EXPIRED_MONTHS, create_monthly, eligible_count, partitions_of, relations_in

CONDITION = "status <> 'open'"


def policy_for(schema: str, **overrides: Any) -> Any:
    data = {
        "chunk_by": "block",
        "key_column": None,
        "condition": None,
        "batch_size": 500,
        "chunk_rows": 1_000,
        **overrides,
    }
    return make_policy(schema, **data)


def purge(conn: Any, policy: Any, cutoff: Any = CUTOFF) -> tuple[Any, int]:
    plan = plan_run(conn, policy, cutoff)
    deleted = 0
    for chunk in plan.chunks:
        deleted += run_chunk(conn, policy, plan.cutoff, chunk).rows_deleted
    assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok
    return plan, deleted


def test_drop_removes_wholly_expired_partitions_and_deletes_the_straddling_one(
    schema: str, conn: Any, admin: Any
) -> None:
    table = create_monthly(admin, schema)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    eligible = eligible_count(admin, table)
    newer = scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at >= %(c)s", {"c": CUTOFF})
    per_month = {m: scalar(admin, f'SELECT count(*) FROM "{schema}"."{m}"') for m in EXPIRED_MONTHS}
    policy = policy_for(schema, expired_partitions="drop")
    plan, deleted = purge(conn, policy)
    actions = [c for c in plan.chunks if c.action]
    assert sorted(c.partition for c in actions) == [f"{schema}.{m}" for m in EXPIRED_MONTHS]
    assert all(c.action == "drop" and c.label().startswith("drop m0") for c in actions)
    # Only the June leaf is purged row by row; July holds nothing eligible and gets no chunk.
    assert {c.partition for c in plan.chunks if not c.action} == {f"{schema}.m06"}
    assert relations_in(admin, schema) == {"events", "m06", "m07"}
    assert eligible_count(admin, table) == 0
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at >= %(c)s", {"c": CUTOFF}) == newer
    assert deleted == eligible == before - scalar(admin, f"SELECT count(*) FROM {table}")
    chunks = {c["chunk_key"]: c for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)}
    for month in EXPIRED_MONTHS:
        row = chunks[f"drop:{schema}.{month}"]
        assert (row["state"], row["outcome"], row["rows_deleted"]) == ("complete", "dropped", per_month[month])
        assert row["action_started_at"] is not None
    # A second run has nothing to drop and finds nothing left.
    later = CUTOFF.replace(hour=13)
    again = plan_run(conn, policy, later)
    assert not [c for c in again.chunks if c.action]
    assert measure_leftovers(conn, policy, later).count == eligible_count(admin, table, later)


def test_detach_keeps_the_partitions_and_moves_them_to_detached_schema(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    keep = f"{schema}_old"
    rows(admin, f'CREATE SCHEMA "{keep}"')
    try:
        expired_rows = scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at < '2024-06-01'")
        policy = policy_for(schema, expired_partitions="detach", detached_schema=keep)
        plan, deleted = purge(conn, policy)
        assert partitions_of(admin, table) == [f"{schema}.m06", f"{schema}.m07"]
        assert relations_in(admin, keep) == set(EXPIRED_MONTHS)
        moved = sum(scalar(admin, f'SELECT count(*) FROM "{keep}"."{m}"') for m in EXPIRED_MONTHS)
        assert moved == expired_rows
        outcomes = {c["outcome"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key) if c["action"]}
        assert outcomes == {"detached"}
        assert eligible_count(admin, table) == 0
        assert deleted == sum(c["rows_deleted"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key))
    finally:
        rows(admin, f'DROP SCHEMA "{keep}" CASCADE')


def test_delete_is_the_default_and_purges_every_leaf_row_by_row(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    policy = policy_for(schema)
    assert policy.expired_partitions == "delete"
    plan, _ = purge(conn, policy)
    assert not [c for c in plan.chunks if c.action]
    assert {c.partition for c in plan.chunks} == {f"{schema}.m0{i}" for i in range(1, 7)}
    assert relations_in(admin, schema) == {"events"} | {f"m0{i}" for i in range(1, 8)}
    assert eligible_count(admin, table) == 0
    assert scalar(admin, f"SELECT count(*) FROM {table}") > 0


def test_with_a_condition_only_partitions_proved_all_eligible_are_dropped(schema: str, conn: Any, admin: Any) -> None:
    # Rows of January and February are all closed; later months hold open rows the condition keeps.
    table = create_monthly(
        admin, schema, status="CASE WHEN mod(g, 7) = 0 AND g > 1500 * 2 THEN 'open' ELSE 'closed' END"
    )
    opened = {
        m: scalar(admin, f'SELECT count(*) FROM "{schema}"."{m}" WHERE status = \'open\'') for m in EXPIRED_MONTHS
    }
    all_closed = sorted(m for m, n in opened.items() if n == 0)
    assert all_closed and len(all_closed) < len(EXPIRED_MONTHS)
    kept_open = scalar(admin, f"SELECT count(*) FROM {table} WHERE status = 'open'")
    policy = policy_for(schema, expired_partitions="drop", condition=CONDITION)
    plan, _ = purge(conn, policy)
    assert sorted(c.partition for c in plan.chunks if c.action) == [f"{schema}.{m}" for m in all_closed]
    assert relations_in(admin, schema).isdisjoint(all_closed)
    assert eligible_count(admin, table, condition=CONDITION) == 0
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE status = 'open'") == kept_open


def test_a_row_reopened_after_planning_keeps_its_partition(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema, status="'closed'")
    policy = policy_for(schema, expired_partitions="drop", condition=CONDITION)
    plan = plan_run(conn, policy, CUTOFF)
    january = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    rows(admin, f"UPDATE {table} SET status = 'open' WHERE id = (SELECT min(id) FROM \"{schema}\".m01)")
    result = run_chunk(conn, policy, plan.cutoff, january)
    assert result.rows_deleted == 0 and result.outcome == "kept"
    assert "m01" in relations_in(admin, schema)
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE status = 'open'") == 1


def test_a_default_partition_means_a_plain_detach_under_lock_timeout(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema, default=True)
    old = scalar(admin, f'SELECT count(*) FROM "{schema}".other')
    policy = policy_for(schema, expired_partitions="drop")
    plan, deleted = purge(conn, policy)
    # The DEFAULT partition holds rows of 2023: no bound proves it expired, so its rows go one by one.
    assert {c.partition for c in plan.chunks if not c.action} == {f"{schema}.m06", f"{schema}.other"}
    assert relations_in(admin, schema) == {"events", "m06", "m07", "other"}
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".other') == 0 < old
    assert eligible_count(admin, table) == 0
    assert deleted > old


@pytest.mark.parametrize("sub", ["hash", "list"])
def test_multi_level_trees_detach_a_whole_expired_month_once(schema: str, conn: Any, admin: Any, sub: str) -> None:
    table = create_monthly(admin, schema, sub=sub)
    eligible = eligible_count(admin, table)
    policy = policy_for(schema, expired_partitions="drop")
    plan, deleted = purge(conn, policy)
    assert sorted(c.partition for c in plan.chunks if c.action) == [f"{schema}.{m}" for m in EXPIRED_MONTHS]
    # June's two leaves are purged in block chunks of their own.
    leaves = {c.partition for c in plan.chunks if not c.action}
    assert len(leaves) == 2 and all(leaf.startswith(f"{schema}.m06_") for leaf in leaves)
    assert not relations_in(admin, schema) & {m for m in EXPIRED_MONTHS}
    assert eligible_count(admin, table) == 0
    assert deleted == eligible


def test_dry_run_counts_partitions_and_changes_nothing(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    before = relations_in(admin, schema), scalar(admin, f"SELECT count(*) FROM {table}")
    policy = policy_for(schema, expired_partitions="drop", dry_run=True)
    plan = plan_run(conn, policy, CUTOFF)
    matched = sum(run_chunk(conn, policy, plan.cutoff, c).rows_matched for c in plan.chunks)
    assert (relations_in(admin, schema), scalar(admin, f"SELECT count(*) FROM {table}")) == before
    assert matched == eligible_count(admin, table)


def test_partitions_detached_or_dropped_between_plan_and_chunk_complete_with_zero_rows(
    schema: str, conn: Any, admin: Any
) -> None:
    table = create_monthly(admin, schema)
    policy = policy_for(schema, expired_partitions="drop")
    plan = plan_run(conn, policy, CUTOFF)
    june = [c for c in plan.chunks if c.partition == f"{schema}.m06"]
    january = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    rows(admin, f'ALTER TABLE {table} DETACH PARTITION "{schema}".m06')
    rows(admin, f'ALTER TABLE {table} DETACH PARTITION "{schema}".m01')
    rows(admin, f'DROP TABLE "{schema}".m01')
    june_rows = scalar(admin, f'SELECT count(*) FROM "{schema}".m06')
    results = [run_chunk(conn, policy, plan.cutoff, c) for c in [*june, january]]
    assert [r.rows_deleted for r in results] == [0] * len(results)
    # Someone else's detached table is never touched.
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m06') == june_rows
    outcomes = {c["chunk_key"]: c["outcome"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)}
    assert {outcomes[c.key] for c in [*june, january]} == {"partition_gone"}


def test_a_leaf_dropped_before_its_block_chunks_run_completes_them_with_zero_rows(
    schema: str, conn: Any, admin: Any
) -> None:
    table = create_monthly(admin, schema)
    policy = policy_for(schema)
    plan = plan_run(conn, policy, CUTOFF)
    february = [c for c in plan.chunks if c.partition == f"{schema}.m02"]
    assert february
    gone = scalar(admin, f'SELECT count(*) FROM "{schema}".m02')
    rows(admin, f'DROP TABLE "{schema}".m02')
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    deleted = sum(run_chunk(conn, policy, plan.cutoff, c).rows_deleted for c in plan.chunks)
    assert eligible_count(admin, table) == 0 and deleted == before - scalar(admin, f"SELECT count(*) FROM {table}")
    outcomes = {c["chunk_key"]: c["outcome"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)}
    assert {outcomes[c.key] for c in february} == {"partition_gone"} and gone > 0
    assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok


def test_a_partition_attached_after_planning_waits_for_the_next_run(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    policy = policy_for(schema)
    plan = plan_run(conn, policy, CUTOFF)
    rows(
        admin,
        f"CREATE TABLE \"{schema}\".y2023 PARTITION OF {table} FOR VALUES FROM ('2023-01-01') TO ('2024-01-01')",
    )
    rows(
        admin,
        f"INSERT INTO {table} SELECT -g, 1, timestamptz '2023-03-01' + g * interval '1 hour', 'x', ''"
        " FROM generate_series(1, 50) g",
    )
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert eligible_count(admin, table) == 50
    assert measure_leftovers(conn, policy, CUTOFF).count == 50
    _, deleted = purge(conn, policy, CUTOFF.replace(minute=5))
    assert deleted == 50 and eligible_count(admin, table) == 0


def test_plan_preview_names_each_partition_action(schema: str, conn: Any, admin: Any) -> None:
    create_monthly(admin, schema)
    preview = compute_plan(conn, policy_for(schema, expired_partitions="drop"), CUTOFF)
    actions = {str(d.relation.table): d.action for d in preview.partitions}
    assert actions == {
        **{f"{schema}.{m}": "drop" for m in EXPIRED_MONTHS},
        f"{schema}.m06": "delete rows",
        f"{schema}.m07": "skip",
    }
    assert Ledger(f"{schema}_ledger").version(conn) is None  # a preview writes nothing


def test_key_chunks_on_a_partitioned_table_say_to_use_block(schema: str, conn: Any, admin: Any) -> None:
    create_monthly(admin, schema)
    with pytest.raises(PermanentError, match=r"partitioned table.*use chunk_by 'block'"):
        plan_run(conn, make_policy(schema, chunk_by="key"), CUTOFF)


def test_bad_partition_settings_name_the_field(schema: str, conn: Any, admin: Any) -> None:
    with pytest.raises(PolicyError) as info:
        policy_for(schema, expired_partitions="truncate")
    assert info.value.field == "expired_partitions" and "'delete', 'detach' or 'drop'" in str(info.value)
    with pytest.raises(PolicyError) as info:
        policy_for(schema, expired_partitions="drop", archive_table=f"{schema}.archive")
    assert info.value.field == "expired_partitions" and "use 'detach'" in str(info.value)
    with pytest.raises(PolicyError) as info:
        policy_for(schema, expired_partitions="drop", detached_schema="keep")
    assert info.value.field == "detached_schema"
    table = create_monthly(admin, schema)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    policy = policy_for(schema, expired_partitions="detach", detached_schema=f"{schema}_nowhere")
    with pytest.raises(PermanentError, match=r"field 'detached_schema'.*does not exist"):
        plan_run(conn, policy, CUTOFF)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before
    assert len(partitions_of(admin, table)) == 7


class _Crash(Exception):
    pass


def test_a_table_dropped_by_someone_else_after_our_detach_completes_the_chunk(
    schema: str, conn: Any, admin: Any
) -> None:
    create_monthly(admin, schema)
    policy = policy_for(schema, expired_partitions="drop")
    plan = plan_run(conn, policy, CUTOFF)
    january = next(c for c in plan.chunks if c.partition == f"{schema}.m01")

    def crash(step: str) -> None:
        if step == "after_detach":
            raise _Crash(step)

    with pytest.raises(_Crash):
        run_chunk(conn, policy, plan.cutoff, january, on_step=crash)
    assert "m01" in relations_in(admin, schema) and f"{schema}.m01" not in partitions_of(admin, f'"{schema}".events')
    rows(admin, f'DROP TABLE "{schema}".m01')
    result = run_chunk(conn, policy, plan.cutoff, january)
    assert (result.rows_deleted, result.outcome) == (0, "partition_gone")
    row = next(c for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key) if c["chunk_key"] == january.key)
    assert (row["state"], row["outcome"]) == ("complete", "partition_gone")


def test_an_expired_partition_with_a_row_without_tenant_is_not_dropped(schema: str, conn: Any, admin: Any) -> None:
    table = create_monthly(admin, schema)
    rows(admin, f"ALTER TABLE {table} ALTER COLUMN tenant_id DROP NOT NULL")
    rows(admin, f'UPDATE {table} SET tenant_id = NULL WHERE id = (SELECT min(id) FROM "{schema}".m02)')
    policy = policy_for(schema, expired_partitions="drop", tenant_column="tenant_id")
    plan, _ = purge(conn, policy)
    dropped = sorted(c.partition for c in plan.chunks if c.action)
    assert f"{schema}.m02" not in dropped and f"{schema}.m01" in dropped
    assert "m02" in relations_in(admin, schema)
    # The row without a tenant is never eligible, so it stays; every other expired row is gone.
    assert scalar(admin, f'SELECT count(*) FROM "{schema}".m02') == 1
    assert (
        scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at < %(c)s AND tenant_id IS NOT NULL", {"c": CUTOFF})
        == 0
    )


@pytest.mark.usefixtures("bounded_small")
def test_the_straddling_leaf_is_read_only_where_its_eligible_rows_are(schema: str, conn: Any, admin: Any) -> None:
    # A monthly partition purged daily: the cutoff (June 1, 12:00) leaves half a day of June eligible.
    table = create_monthly(admin, schema, rows_per_month=40_000)
    june = f'"{schema}"."m06"'
    rows(admin, f"VACUUM ANALYZE {table}")
    june_blocks = scalar(admin, f"SELECT pg_relation_size('{june}') / current_setting('block_size')::int")
    in_june = scalar(admin, f"SELECT count(*) FROM {june} WHERE created_at < %(c)s", {"c": CUTOFF})
    june_rows = scalar(admin, f"SELECT count(*) FROM {june}")
    policy = policy_for(schema, expired_partitions="drop", chunk_rows=None)
    preview = compute_plan(conn, policy, CUTOFF)
    assert preview.partitions is not None
    (decision,) = [d for d in preview.partitions if d.relation.table.name == "m06"]
    assert (decision.action, decision.rows) == ("delete rows", in_june)
    assert decision.reason.startswith("bounded by an index")
    plan, _ = purge(conn, policy)
    (chunk,) = [c for c in plan.chunks if c.partition == f"{schema}.m06"]
    assert chunk.rows_planned == in_june > 0  # counted, not sampled
    assert chunk.lo == 0 and chunk.hi < june_blocks // 4
    assert eligible_count(admin, table) == 0
    assert scalar(admin, f"SELECT count(*) FROM {june}") == june_rows - in_june


def test_index_bounded_leaves_past_the_chunk_budget_are_planned_over_every_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_retention.core.planning.partitions import RowLeaf, fit
    from airflow_retention.core.planning.tree import Relation
    from airflow_retention.core.planning.walkers import spans
    from airflow_retention.core.planning.walkers.spans import BoundedBlocks
    from airflow_retention.core.policy.identifiers import TableName

    monkeypatch.setattr(spans, "BOUNDED_GAP_BLOCKS", 10)

    def leaf(oid: int) -> RowLeaf:
        relation = Relation(oid, 1, 1, False, "r", TableName("s", f"p{oid}"), None, 1000, 50_000.0, None, None)
        # Three runs of rows far apart: three chunks at any chunk size.
        spans = [(0, 16, 100), (400, 416, 100), (900, 916, 100)]
        return RowLeaf(relation, [(0, 5), (450, 5)], 10.0, 300, BoundedBlocks(spans=spans, blocks=48, rows=300))

    # Two leaves, a budget of 4 chunks: the bounded ranges need 6, so both leaves cover every block.
    _, ranges = fit([leaf(2), leaf(3)], 1000, 4)
    assert sum(len(r) for r in ranges) <= 4
    assert all(r[0][0] == 0 and r[-1][1] == 1000 for r in ranges)
    # With room for them the runs stay apart.
    _, ranges = fit([leaf(2), leaf(3)], 1000, 6)
    assert ranges[0] == [(0, 16, 100), (400, 416, 100), (900, 916, 100)]
