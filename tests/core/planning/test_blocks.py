"""``chunk_by: block``: chunks and batches as ranges of the table's physical blocks (TID range scans),
planned from a repeatable sample. Every test runs on the real server, on both drivers."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PolicyError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import compute_plan, plan_run
from airflow_retention.core.running.engine import BatchReport, run_chunk
from airflow_retention.core.sql.batches import batch_statement
from tests.core.helpers import (
    CUTOFF,
    ELIGIBLE,
    create_events,
    eligible_ids,
    fill_events,
    ids,
    make_policy,
    rows,
    scalar,
)

ROWS = 40_000


def block_policy(schema: str, **overrides: Any) -> Any:
    return make_policy(schema, **{"chunk_by": "block", "batch_size": 2000, "chunk_rows": 5000, **overrides})


def table(admin: Any, schema: str, count: int = ROWS) -> str:
    name = create_events(admin, schema)
    fill_events(admin, name, count)
    rows(admin, f"VACUUM ANALYZE {name}")
    return name


def relation_blocks(admin: Any, name: str) -> int:
    return scalar(admin, f"SELECT pg_relation_size('{name}') / current_setting('block_size')::int")


def test_the_plan_covers_every_block_once_and_is_repeatable(schema: str, conn: Any, admin: Any) -> None:
    name = table(admin, schema)
    policy = block_policy(schema)
    first = compute_plan(conn, policy, CUTOFF)
    second = compute_plan(conn, policy, CUTOFF)
    assert [c.key for c in first.chunks] == [c.key for c in second.chunks]
    assert len(first.chunks) > 1
    assert all(c.key == f"blocks:{c.lo}-{c.hi}" and c.tenants is None for c in first.chunks)
    # Contiguous from block 0 to the end of the table: no eligible row can fall between two chunks.
    assert first.chunks[0].lo == 0
    assert all(a.hi == b.lo for a, b in zip(first.chunks, first.chunks[1:], strict=False))
    assert first.chunks[-1].hi == relation_blocks(admin, name)
    # The sample's estimate is close to the truth (a 30,000-row sample of 40,000 rows).
    truth = len(eligible_ids(admin, name))
    assert abs(first.rows_planned - truth) <= truth * 0.15
    assert first.rows_estimated  # and says so ("~" in the CLI and the logs)
    assert first.chunks[0].label() == f"blocks [0, {first.chunks[0].hi})"  # the key's numbers


def test_a_block_purge_deletes_exactly_the_eligible_rows(schema: str, conn: Any, admin: Any) -> None:
    name = table(admin, schema)
    policy = block_policy(schema)
    eligible = set(eligible_ids(admin, name))
    kept = ids(admin, name) - eligible
    plan = plan_run(conn, policy, CUTOFF)
    results = [run_chunk(conn, policy, plan.cutoff, chunk) for chunk in plan.chunks]
    assert ids(admin, name) == kept
    assert sum(r.rows_deleted for r in results) == len(eligible)
    ledger = Ledger(policy.ledger_schema)
    chunks = ledger.chunk_rows(admin, plan.run_key)
    assert all(c["state"] == "complete" and c["next_key"] == c["hi"] for c in chunks)
    assert sum(c["rows_deleted"] for c in chunks) == len(eligible)
    # A replay finds every chunk complete and deletes nothing.
    assert all(run_chunk(conn, policy, plan.cutoff, c).already_complete for c in plan.chunks)


def test_a_killed_block_chunk_resumes_after_its_last_committed_batch(schema: str, conn: Any, admin: Any) -> None:
    name = table(admin, schema)
    policy = block_policy(schema, batch_size=1000)
    eligible = set(eligible_ids(admin, name))
    block_of = dict(rows(admin, f"SELECT id, (ctid::text::point)[0]::bigint FROM {name}"))
    plan = plan_run(conn, policy, CUTOFF)
    chunk = plan.chunks[0]
    seen: list[BatchReport] = []

    def die_after_two(report: BatchReport) -> None:
        seen.append(report)
        if len(seen) == 2:
            raise KeyboardInterrupt("worker killed")

    with pytest.raises(KeyboardInterrupt):
        run_chunk(conn, policy, plan.cutoff, chunk, on_batch=die_after_two)
    ledger = Ledger(policy.ledger_schema)
    row = ledger.chunk_rows(admin, plan.run_key)[0]
    assert row["state"] == "running" and row["batches"] == 2
    assert row["next_key"] == seen[1].hi and chunk.lo < row["next_key"] < chunk.hi
    # Exactly the eligible rows of the two committed batches' blocks are gone.
    gone = eligible - ids(admin, name)
    assert gone == {i for i in eligible if block_of[i] < row["next_key"]}
    assert len(gone) == row["rows_deleted"] == seen[0].deleted + seen[1].deleted > 0

    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert result.resumed_from == row["next_key"]
    assert ledger.chunk_rows(admin, plan.run_key)[0]["rows_deleted"] == row["rows_deleted"] + result.rows_deleted
    for rest in plan.chunks[1:]:
        run_chunk(conn, policy, plan.cutoff, rest)
    assert ids(admin, name) == set(block_of) - eligible
    assert sum(c["rows_deleted"] for c in ledger.chunk_rows(admin, plan.run_key)) == len(eligible)


def test_archive_and_dry_run_by_block(schema: str, conn: Any, admin: Any) -> None:
    name = table(admin, schema, 10_000)
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {name})')
    eligible = set(eligible_ids(admin, name))
    dry = block_policy(schema, name="dry", dry_run=True)
    plan = plan_run(conn, dry, CUTOFF)
    matched = sum(run_chunk(conn, dry, plan.cutoff, c).rows_matched for c in plan.chunks)
    assert matched == len(eligible) and len(eligible_ids(admin, name)) == len(eligible)
    archiving = block_policy(schema, name="archiving", archive_table=f"{schema}.archive")
    plan = plan_run(conn, archiving, CUTOFF)
    results = [run_chunk(conn, archiving, plan.cutoff, c) for c in plan.chunks]
    assert sum(r.rows_archived for r in results) == sum(r.rows_deleted for r in results) == len(eligible)
    assert ids(admin, f'"{schema}".archive') == eligible


def test_batches_read_their_blocks_with_a_tid_range_scan(schema: str, conn: Any, admin: Any) -> None:
    table(admin, schema, 5000)
    policy = block_policy(schema)
    dbapi.prepare(conn)
    target = inspect_target(conn, policy)
    with dbapi.transaction(conn) as cur:
        cur.execute(
            "EXPLAIN " + batch_statement(policy, target, tenant_filter=False),
            {"cutoff": CUTOFF, "lo_tid": "(0,0)", "hi_tid": "(10,0)"},
        )
        plan = "\n".join(r[0] for r in cur.fetchall())
        conn.rollback()
    assert "Tid Range Scan" in plan, plan


def test_an_unknown_chunk_by_is_refused(schema: str) -> None:
    assert make_policy(schema, chunk_by="block", tenant_column="tenant_id").chunk_by == "block"  # one pass
    with pytest.raises(PolicyError) as info:
        make_policy(schema, chunk_by="pages")
    assert info.value.field == "chunk_by" and "'key' or 'block'" in str(info.value)


def test_a_lone_block_chunk_over_the_whole_range_stops_at_the_tables_end(schema: str, conn: Any, admin: Any) -> None:
    from airflow_retention.core.ledger.records import ChunkSpec

    name = table(admin, schema)
    expected = eligible_ids(admin, name)
    policy = block_policy(schema)
    chunk = ChunkSpec(key="all:0-4611686018427387904", lo=0, hi=2**62)
    result = run_chunk(conn, policy, CUTOFF, chunk, lone=True)
    assert result.rows_deleted == len(expected) > 0
    assert eligible_ids(admin, name) == []
    # It stopped at the table's last block: a handful of batches, not 2**62 blocks' worth.
    assert result.batches <= relation_blocks(admin, name) + 1
    assert run_chunk(conn, policy, CUTOFF, chunk, lone=True).already_complete


def test_the_blocks_after_the_last_sampled_eligible_row_join_the_last_range() -> None:
    from airflow_retention.core.planning.walkers.blocks import block_ranges

    sampled = [(0, 10), (5, 10)]
    # One range's worth: one range to the table's end, not a second one for blocks 6-19.
    assert block_ranges(sampled, 1.0, 20, 20) == [(0, 20, 20)]
    assert block_ranges(sampled, 1.0, 20, 10) == [(0, 1, 10), (1, 20, 10)]
    assert block_ranges(sampled, 1.0, 6, 10) == [(0, 1, 10), (1, 6, 10)]
    # Nothing sampled: one range over every block; an empty table: none.
    assert block_ranges([], 1.0, 20, 10) == [(0, 20, 0)]
    assert block_ranges([], 1.0, 0, 10) == []
    # A block the sample saw beyond the measured end (the table grew since) makes no cut either.
    assert block_ranges([(0, 10), (5, 10), (25, 10)], 1.0, 20, 10) == [(0, 1, 10), (1, 20, 20)]
    # max_ranges still bounds the count, and the ranges still meet end to end.
    assert block_ranges([(b, 10) for b in range(10)], 1.0, 12, 10, max_ranges=3) == [
        (0, 1, 10),
        (1, 2, 10),
        (2, 12, 80),
    ]


def test_a_small_purge_of_an_appended_table_is_one_chunk_and_still_covers_its_tail(
    schema: str, conn: Any, admin: Any
) -> None:
    # Rows in insertion order of time: the eligible ones fill the first blocks, the newer ones the rest.
    name = create_events(admin, schema)
    fill_events(admin, name, 20_000, created="%(cutoff)s::timestamptz + (g - 8000) * interval '1 minute'")
    # Free space in the newest blocks (no page left empty, so VACUUM keeps them), for rows inserted later.
    rows(admin, f"DELETE FROM {name} WHERE id > 12000 AND mod(id, 2) = 0")
    rows(admin, f"VACUUM ANALYZE {name}")
    blocks = relation_blocks(admin, name)
    policy = block_policy(schema, chunk_rows=None)  # chunks sized by time: this purge is one chunk's work
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.sizing is not None and plan.sizing.chunks == 1
    (chunk,) = plan.chunks
    assert (chunk.lo, chunk.hi) == (0, blocks)
    # Eligible rows inserted after planning: into the free space of the tail (the chunk's blocks) or
    # past the measured end of the table (left for the next run, never half covered).
    rows(
        admin,
        f"INSERT INTO {name} (id, tenant_id, created_at, status, payload)"
        " SELECT g, 1, %(cutoff)s::timestamptz - interval '1 day', 'closed', md5(g::text)"
        " FROM generate_series(100001, 106000) AS g",
        {"cutoff": CUTOFF},
    )
    block_of = dict(rows(admin, f"SELECT id, (ctid::text::point)[0]::bigint FROM {name} WHERE id > 100000"))
    inside = {i for i, b in block_of.items() if b < blocks}
    assert inside and max(block_of[i] for i in inside) > blocks // 2  # some did land in the tail
    eligible_before = set(eligible_ids(admin, name))
    run_chunk(conn, policy, plan.cutoff, chunk)
    assert set(eligible_ids(admin, name)) == eligible_before - {i for i in eligible_before if i <= 100000} - inside
    assert set(eligible_ids(admin, name)) == set(block_of) - inside


# Index-bounded block chunks: a nightly purge of a table much larger than its day of eligible rows.
NIGHTLY_ROWS = 60_000
# Two separate runs of eligible rows (ids 1-1500 and 40001-41500), the rest newer than the cutoff.
TWO_RUNS = (
    "%(cutoff)s::timestamptz + CASE WHEN g <= 1500 OR g BETWEEN 40001 AND 41500"
    " THEN -interval '1 hour' ELSE interval '1 hour' END"
)


def nightly_table(admin: Any, schema: str, created: str = TWO_RUNS, **create: Any) -> str:
    name = create_events(admin, schema, **create)
    fill_events(admin, name, NIGHTLY_ROWS, created=created)
    rows(admin, f"VACUUM ANALYZE {name}")
    return name


def block_of(admin: Any, name: str, where: str) -> set[int]:
    sql = f"SELECT DISTINCT (ctid::text::point)[0]::bigint FROM {name} WHERE {where}"
    return {b for (b,) in rows(admin, sql, {"cutoff": CUTOFF})}


@pytest.mark.usefixtures("bounded_small")
def test_a_nightly_purge_reads_only_the_blocks_that_hold_eligible_rows(schema: str, conn: Any, admin: Any) -> None:
    name = nightly_table(admin, schema)
    blocks = relation_blocks(admin, name)
    eligible = set(eligible_ids(admin, name))
    kept = ids(admin, name) - eligible
    policy = block_policy(schema, chunk_rows=None)
    plan = plan_run(conn, policy, CUTOFF)
    # One chunk's work by time, but two chunks: the blocks between the two runs of rows are in none.
    assert [(c.lo, c.hi) for c in plan.chunks] == sorted((c.lo, c.hi) for c in plan.chunks)
    assert len(plan.chunks) == 2
    assert plan.rows_planned == len(eligible) and not plan.rows_estimated  # counted, not sampled
    # A retry reuses the stored plan, whose ledger row does not say how its block chunks were counted.
    assert plan_run(conn, policy, CUTOFF).rows_estimated
    assert plan.sizing is not None and "bounded by an index" in plan.sizing.reason
    covered = {b for c in plan.chunks for b in range(c.lo, c.hi)}
    assert block_of(admin, name, ELIGIBLE) <= covered
    assert len(covered) < blocks // 4
    assert not block_of(admin, name, "id BETWEEN 15000 AND 25000") & covered
    assert plan.chunks[-1].hi < blocks  # the newest blocks hold no eligible row: not read
    results = [run_chunk(conn, policy, plan.cutoff, chunk) for chunk in plan.chunks]
    assert sum(r.rows_deleted for r in results) == len(eligible)
    assert ids(admin, name) == kept
    assert eligible_ids(admin, name) == []


@pytest.mark.usefixtures("bounded_small")
@pytest.mark.parametrize(
    ("created", "create"),
    [
        pytest.param(TWO_RUNS, {"ts_index": False}, id="no-timestamp-index"),
        pytest.param(
            "%(cutoff)s::timestamptz + CASE WHEN mod(g, 3) = 0 THEN -interval '1 hour' ELSE interval '1 hour' END",
            {},
            id="eligible-rows-in-every-block",
        ),
    ],
)
def test_without_an_index_to_use_the_plan_covers_every_block(
    schema: str, conn: Any, admin: Any, created: str, create: dict[str, Any]
) -> None:
    name = nightly_table(admin, schema, created, **create)
    plan = compute_plan(conn, block_policy(schema), CUTOFF)
    assert plan.chunks[0].lo == 0
    assert all(a.hi == b.lo for a, b in zip(plan.chunks, plan.chunks[1:], strict=False))
    assert plan.chunks[-1].hi == relation_blocks(admin, name)
    assert plan.sizing is not None and "bounded" not in plan.sizing.reason
    assert plan.rows_estimated  # a sample of part of the table


def test_a_sample_of_every_block_is_a_count(schema: str, conn: Any, admin: Any) -> None:
    # Below BLOCK_SAMPLE_ROWS the sample is 100 %: every block, so rows_planned is the exact count.
    name = table(admin, schema, count=5_000)
    plan = compute_plan(conn, block_policy(schema), CUTOFF)
    assert plan.rows_planned == len(eligible_ids(admin, name)) > 0
    assert not plan.rows_estimated


def test_the_planner_log_marks_a_sample_estimate(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table(admin, schema)
    with caplog.at_level("INFO", logger="airflow_retention.core.planning"):
        plan = plan_run(conn, block_policy(schema), CUTOFF)
    assert plan.rows_estimated
    (line,) = [r.getMessage() for r in caplog.records if " planned " in r.getMessage()]
    assert f"planned {len(plan.chunks)} chunk(s), ~{plan.rows_planned} eligible rows," in line
    assert "tenant group" not in line  # a policy without tenants


@pytest.mark.usefixtures("bounded_small")
def test_a_slow_count_through_the_index_falls_back_to_every_block(
    schema: str, conn: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_retention.core.planning.walkers import spans

    name = nightly_table(admin, schema)
    monkeypatch.setattr(spans, "BOUNDED_TIMEOUT_MS", 50)
    # 0.1 ms per eligible row the index finds: the 3,000 of them take about 0.3 s to count.
    policy = block_policy(schema, condition="status <> 'open' AND pg_sleep(0.0001) IS NOT NULL")
    plan = compute_plan(conn, policy, CUTOFF)
    assert (plan.chunks[0].lo, plan.chunks[-1].hi) == (0, relation_blocks(admin, name))


@pytest.mark.usefixtures("bounded_small")
def test_nothing_eligible_by_the_index_is_a_run_of_no_chunk(schema: str, conn: Any, admin: Any) -> None:
    name = nightly_table(admin, schema, "%(cutoff)s::timestamptz + interval '1 hour'")
    policy = block_policy(schema)
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.chunks == [] and plan.rows_planned == 0
    # The probe through the timestamp index proves it before any count (tests/core/planning/test_empty_plans.py).
    assert plan.sizing is not None and plan.sizing.reason.startswith("nothing eligible: no row of")
    run = Ledger(policy.ledger_schema).get_run(admin, plan.run_key)
    assert run is not None and run["state"] == "complete"
    assert scalar(admin, f"SELECT count(*) FROM {name}") == NIGHTLY_ROWS


def test_bounded_ranges_cut_at_long_gaps_and_at_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_retention.core.planning.walkers import spans as walker

    monkeypatch.setattr(walker, "BOUNDED_GAP_BLOCKS", 10)
    spans = [(0, 4, 5), (4, 8, 5), (16, 20, 5), (40, 44, 5), (44, 48, 5)]
    # A gap of 8 blocks is read; one of 20 is not.
    assert walker.bounded_ranges(spans, 100) == [(0, 20, 15), (40, 48, 10)]
    # Cut at the size too; the blocks between two cut ranges hold no eligible row.
    assert walker.bounded_ranges(spans, 10) == [(0, 8, 10), (16, 20, 5), (40, 48, 10)]
    assert walker.bounded_ranges([], 10) == []
