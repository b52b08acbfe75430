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
from tests.core.partition_helpers import (
    EXPIRED_MONTHS,
    HASH_LEAVES,
    create_hashed,
    create_monthly,
    eligible_count,
    insert_night,
    partitions_of,
    relations_in,
)

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


# -- leaves past the chunk budget (issue 32, item 4) ------------------------------------------------------


def eligible_per_leaf(admin: Any, schema: str, cutoff: Any, ids_from: int = 0) -> dict[str, int]:
    return {
        leaf: scalar(
            admin,
            f'SELECT count(*) FROM "{schema}"."{leaf}" WHERE created_at < %(c)s AND id >= %(i)s',
            {"c": cutoff, "i": ids_from},
        )
        for leaf in HASH_LEAVES
    }


def test_leaves_past_the_chunk_budget_are_carried_over_and_the_run_says_it_did_not_cover_them(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Four hash leaves getting rows every night, a budget of two chunks: a fixed order purged h0 and h1
    every night and never h2 and h3, whose eligible rows grew night after night while every run verified
    complete. Now each night plans the leaves least recently covered: every leaf is covered within two
    nights, no leaf keeps more than the night's rows, and a run's verify names the leaves it left."""
    from datetime import timedelta

    table = create_hashed(admin, schema)
    policy = policy_for(schema, table=f"{schema}.t")
    ledger = Ledger(policy.ledger_schema)
    name = {leaf: f"{schema}.{leaf}" for leaf in HASH_LEAVES}
    expected = [["t_h0", "t_h1"], ["t_h2", "t_h3"], ["t_h0", "t_h1"]]
    last_covered: dict[str, int] = {}
    for night in range(3):
        cutoff = CUTOFF + timedelta(days=night)
        insert_night(admin, table, night, cutoff)
        if night == 1:  # the preview reads the coverage too, and writes nothing
            runs_before = scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs')
            preview = compute_plan(conn, policy, cutoff, max_chunks=2)
            assert {c.partition for c in preview.chunks} == {name["t_h2"], name["t_h3"]}
            assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == runs_before
        caplog.clear()
        with caplog.at_level("WARNING", logger="airflow_retention.core.planning"):
            plan = plan_run(conn, policy, cutoff, max_chunks=2)
        planned = sorted({c.partition for c in plan.chunks})
        deferred = [name[leaf] for leaf in HASH_LEAVES if name[leaf] not in planned]
        assert planned == [name[leaf] for leaf in expected[night]]
        (warning,) = [r.getMessage() for r in caplog.records if "max_map_length" in r.getMessage()]
        assert f"does not cover 2 ({', '.join(deferred)})" in warning and "the next run plans those first" in warning
        assert plan_run(conn, policy, cutoff, max_chunks=2).chunks == plan.chunks  # a re-plan: the stored plan
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        verification = verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks])
        assert verification.ok and not verification.covers_all and verification.deferred == deferred
        said = verification.describe()
        assert "all 2 planned chunk(s) complete" in said and "expected chunk(s) complete" not in said
        assert "2 leaf partition(s) with eligible rows not covered by this run (past the chunk budget of 2;" in said
        assert f"{', '.join(deferred)} — the next run plans them first" in said
        assert ledger.get_run(conn, plan.run_key)["leaves_deferred"] == deferred
        for leaf in HASH_LEAVES:
            if name[leaf] in planned:
                last_covered[leaf] = night
        # Eligible rows never pile up: a leaf holds at most the rows of the nights since it was last covered,
        # and it was covered this night or the one before.
        left = eligible_per_leaf(admin, schema, cutoff)
        tonight = eligible_per_leaf(admin, schema, cutoff, ids_from=night * 1_000_000)
        for leaf in HASH_LEAVES:
            assert left[leaf] == (0 if last_covered.get(leaf) == night else tonight[leaf]), (night, leaf, left)
        if night >= 1:
            assert set(last_covered) == set(HASH_LEAVES)  # every leaf covered within ceil(4 / 2) = 2 nights


def test_the_plan_preview_carries_leaves_over_without_a_ledger(schema: str, conn: Any, admin: Any) -> None:
    """compute_plan on a policy never run (no ledger schema at all): the tree's order, the rest deferred,
    and still nothing written."""
    table = create_hashed(admin, schema)
    insert_night(admin, table, 0, CUTOFF)
    policy = policy_for(schema, table=f"{schema}.t")
    preview = compute_plan(conn, policy, CUTOFF, max_chunks=2)
    assert [c.partition for c in preview.chunks] == [f"{schema}.t_h0", f"{schema}.t_h1"]
    assert preview.leaves_deferred == (f"{schema}.t_h2", f"{schema}.t_h3")
    reasons = {str(d.relation.table): d.reason for d in preview.partitions}
    assert "deferred past the chunk budget" in reasons[f"{schema}.t_h3"]
    assert "deferred" not in reasons[f"{schema}.t_h0"]
    assert scalar(admin, "SELECT count(*) FROM pg_namespace WHERE nspname = %(s)s", {"s": policy.ledger_schema}) == 0
    # With room for every leaf nothing is deferred (an empty list, not None: a partitioned table's plan).
    assert compute_plan(conn, policy, CUTOFF, max_chunks=8).leaves_deferred == ()
