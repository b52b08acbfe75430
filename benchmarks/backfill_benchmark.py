"""Backfill benchmark: one nightly run against thirty backfilled days that have nothing left to delete,
measured side by side in one run, with the planner's probe for an empty run and without it.

    python benchmarks/backfill_benchmark.py [--rows N] [--backfills 30] [--stale-stats] [--no-condition]
                                            [--dsn DSN] [--keep] [--json out.json]

Builds ``bench.events`` with N rows (the purge benchmark's shape: 100 days of rows, about 100 bytes of
payload, every 17th row ``open`` and kept by the condition, a primary key, an index on ``created_at``
and on ``(tenant_id, id)``) as the earlier nightly runs have left it: nothing eligible before the day
before the cutoff, vacuumed and analysed. Then, through the core planner and engine (no Airflow), with
the default block chunks:

1. the nightly run at the cutoff: plan + every chunk (one day of rows);
2. ``--backfills`` earlier days (cutoffs 1, 2, ... days before), each planned and its chunks run: with
   an index on ``created_at`` each is proven empty by the planner's probe (0 chunks);
3. the same days again under another policy name, the probe switched off: what the planner did before
   it (an exact count through the index for a large table, else a sample and chunks over every block).

For each: seconds, chunks, rows deleted, and the table's heap and index pages touched (buffer hits and
reads from ``pg_statio_user_tables``). ``--stale-stats`` leaves out the ANALYZE after the earlier runs'
delete (and turns autovacuum off on the table): the statistics still show the deleted rows, the state
of a table in the hours after a large purge. The database ``retention_backfill_bench`` is created and
dropped at the end (``--keep`` keeps it). ``--no-condition``: a policy without a condition, so that no
row before the cutoff is kept (the earlier runs deleted them all): the probe's best case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_retention.core.planning.planner import plan_run  # noqa: E402
from airflow_retention.core.planning.walkers import blocks, keys, partitions  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running.engine import run_chunk  # noqa: E402
from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

DB = os.environ.get("RETENTION_BENCH_DB", "retention_backfill_bench")
CUTOFF = datetime(2026, 1, 1, tzinfo=timezone.utc)
BUILD_SQL = (
    "CREATE SCHEMA bench",
    """CREATE TABLE bench.events AS
       SELECT g::bigint AS id, (g %% 50)::integer AS tenant_id,
              %(cutoff)s::timestamptz - interval '60 days' + (g::float / %(rows)s) * interval '100 days' AS created_at,
              CASE WHEN g %% 17 = 0 THEN 'open' ELSE 'closed' END AS status,
              repeat(md5(g::text), 3) AS payload
       FROM generate_series(1, %(rows)s) g""",
    "ALTER TABLE bench.events ADD PRIMARY KEY (id)",
    "CREATE INDEX events_created_at_idx ON bench.events (created_at)",
    "CREATE INDEX ON bench.events (tenant_id, id)",
    # What the earlier nightly runs left: nothing eligible before the day before the cutoff.
    "DELETE FROM bench.events WHERE created_at < %(cutoff)s::timestamptz - interval '1 day' AND {eligible}",
)
CONDITION = "status <> 'open'"
PAGES = (
    "SELECT coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0), coalesce(idx_blks_read, 0)"
    " + coalesce(idx_blks_hit, 0) FROM pg_statio_user_tables WHERE relid = 'bench.events'::regclass"
)


def bench_policy(name: str, condition: str | None = CONDITION) -> RetentionPolicy:
    """The purge benchmark's policy: one day of retention, a condition, block chunks (the default)."""
    return RetentionPolicy(
        name=name,
        conn_id="retention_target",
        table="bench.events",
        key_column="id",
        timestamp_column="created_at",
        retention="1 day",
        condition=condition,
        ledger_schema="bench_ledger",
        schedule=None,
        retries=0,
    )


def pages(dsn: str) -> tuple[int, int]:
    """Heap and index pages of bench.events touched so far (every session that touched them has closed,
    so their counts are flushed)."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute(PAGES)
        heap, index = cur.fetchone()
    conn.close()
    return int(heap), int(index)


def runs(dsn: str, policy: RetentionPolicy, cutoffs: list[datetime]) -> dict[str, Any]:
    """Plan and run every chunk of each cutoff's run, one after the other, on one connection."""
    before = pages(dsn)
    conn = psycopg2.connect(dsn)
    each: list[float] = []
    planning = 0.0
    chunks = deleted = 0
    reasons: list[str] = []
    for cutoff in cutoffs:
        started = time.perf_counter()
        plan = plan_run(conn, policy, cutoff)
        planning += time.perf_counter() - started
        for chunk in plan.chunks:
            deleted += run_chunk(conn, policy, plan.cutoff, chunk).rows_deleted
        each.append(time.perf_counter() - started)
        chunks += len(plan.chunks)
        reasons.append(plan.sizing.reason if plan.sizing else "stored plan")
    conn.close()
    after = pages(dsn)
    return {
        "runs": len(cutoffs),
        "seconds": sum(each),
        "planning_s": planning,
        "slowest_s": max(each),
        "chunks": chunks,
        "rows_deleted": deleted,
        "heap_pages": after[0] - before[0],
        "index_pages": after[1] - before[1],
        "reasons": reasons,
    }


def build(dsn: str, rows: int, stale: bool, condition: str | None) -> dict[str, Any]:
    print(f"building bench.events with {rows:,} rows ...", flush=True)
    started = time.perf_counter()
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        for statement in BUILD_SQL:
            cur.execute(statement.replace("{eligible}", condition or "true"), {"rows": rows, "cutoff": CUTOFF})
        if stale:
            cur.execute("ALTER TABLE bench.events SET (autovacuum_enabled = false)")
            cur.execute("ANALYZE bench.events (id)")  # statistics of the other columns: from before the delete
        cur.execute("VACUUM" + ("" if stale else " ANALYZE") + " bench.events")
        cur.execute("CHECKPOINT")
        cur.execute("SELECT count(*), pg_relation_size('bench.events') / 8192 FROM bench.events")
        left, blocks = cur.fetchone()
    conn.close()
    print(f"  {left:,} rows in {blocks:,} blocks ({time.perf_counter() - started:.0f} s)", flush=True)
    return {"rows_left": left, "blocks": blocks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--backfills", type=int, default=30)
    parser.add_argument("--stale-stats", action="store_true", help="no ANALYZE after the earlier runs' delete")
    parser.add_argument("--dsn", help=f"PostgreSQL server (a database {DB!r} is created on it and dropped)")
    parser.add_argument("--keep", action="store_true", help="keep the database at the end")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument(
        "--no-condition",
        action="store_true",
        help="a policy without a condition: every row before the cutoff is eligible, none is kept",
    )
    args = parser.parse_args(argv)
    condition = None if args.no_condition else CONDITION

    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    days = [CUTOFF - timedelta(days=d) for d in range(1, args.backfills + 1)]
    try:
        table = build(dsn, args.rows, args.stale_stats, condition)
        print("running the nightly run ...", flush=True)
        nightly = runs(dsn, bench_policy("bench", condition), [CUTOFF])
        print(f"running {args.backfills} backfilled days ...", flush=True)
        probed = runs(dsn, bench_policy("bench", condition), days)
        print(f"running the {args.backfills} days again without the probe ...", flush=True)
        # Each walker's planning calls the probe by its own name for it.
        walkers = (blocks, keys, partitions)
        probe = blocks.nothing_eligible
        for walker in walkers:
            walker.nothing_eligible = lambda *_, **__: None  # type: ignore[assignment]
        try:
            unprobed = runs(dsn, bench_policy("bench_noprobe", condition), days)
        finally:
            for walker in walkers:
                walker.nothing_eligible = probe  # type: ignore[assignment]
    finally:
        if not args.keep:
            admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    stats = ("stale statistics" if args.stale_stats else "fresh statistics") + (
        "; no condition" if condition is None else f"; condition {condition}"
    )
    print()
    print(f"{args.rows:,} rows built, {table['rows_left']:,} left in {table['blocks']:,} blocks; {stats}")
    header = f"{'':<40} {'s':>8} {'x nightly':>10} {'chunks':>7} {'rows':>9} {'heap pages':>11} {'index pages':>12}"
    print(header)
    rows = [
        ("nightly run (plan + chunks)", nightly),
        (f"{args.backfills} backfilled days, probe", probed),
        (f"{args.backfills} backfilled days, no probe", unprobed),
    ]
    for name, r in rows:
        print(
            f"{name:<40} {r['seconds']:>8.2f} {r['seconds'] / nightly['seconds']:>10.3f} {r['chunks']:>7}"
            f" {r['rows_deleted']:>9,} {r['heap_pages']:>11,} {r['index_pages']:>12,}"
        )
    print(
        f"per backfilled day: {probed['seconds'] / args.backfills * 1000:.0f} ms with the probe (slowest"
        f" {probed['slowest_s'] * 1000:.0f} ms), {unprobed['seconds'] / args.backfills * 1000:.0f} ms without;"
        f" without / with: {unprobed['seconds'] / max(probed['seconds'], 1e-9):.1f}x"
    )
    for name, r in rows:  # the planner's own words, for the first day of each
        print(f"  {name}: {r['reasons'][0]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"rows": args.rows, "stale_stats": args.stale_stats, "condition": condition, **table}
        data.update({"nightly": nightly, "backfills_probe": probed, "backfills_no_probe": unprobed})
        args.json.write_text(json.dumps(data, indent=2))
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
