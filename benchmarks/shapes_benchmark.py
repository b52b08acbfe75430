"""Table shapes benchmark: the planner + chunk engine on a table keyed by a uuid (no integer key) and on a
table partitioned by month, each against one unbounded DELETE measured in the same run.

    python benchmarks/shapes_benchmark.py [--rows N] [--shapes uuid partitioned]
                                          [--methods a c p-drop p-delete] [--dsn DSN] [--json out.json]

**uuid**: N rows, ``id uuid PRIMARY KEY DEFAULT gen_random_uuid()``, ``created_at`` (indexed), a status and
about 200 bytes of payload, older rows first, about 56 % eligible (older than the cutoff and not
``open``). Methods: (a) one unbounded ``DELETE``; (c) the planner + engine with block chunks and a
key-less policy (``key_column`` None), one worker.

**partitioned**: N rows over 6 monthly RANGE partitions on ``created_at`` (``PRIMARY KEY (id,
created_at)``), the cutoff in the middle of the fifth month: four partitions wholly expired, one
straddling, one newer. No condition (a condition forces the atomic, plain DETACH). Methods: (a) one
unbounded ``DELETE`` on the parent; (p-drop) planner + engine with ``expired_partitions: drop``; (p-delete)
the same with ``expired_partitions: delete`` (every row in block batches).

Each table is built once (a template) and copied before every method, vacuumed and analysed. For each
method: wall seconds, rows/s, WAL (``pg_current_wal_lsn()``), the longest writing transaction and the
foreground load's p50/p99 (both from ``purge_benchmark``), the engine's batch transactions (p50/p99/max
of ``BatchReport.ms``) and, for p-drop, each DETACH's duration (the engine's ``on_step`` hooks) and its
lock wait (``pg_stat_activity`` sampled every 5 ms from another process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from purge_benchmark import (  # noqa: E402
    REPO,
    Foreground,
    Result,
    TxnMonitor,
    _Sidecar,
    one,
    wal_lsn,
)

from airflow_retention.core.planning.planner import plan_run  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running.engine import run_chunk  # noqa: E402
from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

DB = "retention_shapes_bench"
LEDGER = "bench_ledger"
TXN_SAMPLE_S = 0.01  # the longest-transaction monitor's interval
DETACH_SAMPLE_S = 0.005  # the DETACH sampler's interval
IDLE_SECONDS = 3.0

# -- uuid keys -------------------------------------------------------------------------------------------
UUID_CUTOFF = datetime(2026, 1, 1, tzinfo=timezone.utc)
UUID_TEMPLATE_SQL = """
DROP TABLE IF EXISTS bench.utemplate;
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE bench.utemplate AS
SELECT gen_random_uuid() AS id,
       %(cutoff)s::timestamptz - interval '60 days' + (g::float / %(rows)s) * interval '100 days' AS created_at,
       CASE WHEN g %% 17 = 0 THEN 'open' ELSE 'closed' END AS status,
       repeat(md5(g::text), 6) AS payload
FROM generate_series(1, %(rows)s) g;
"""
UUID_COPY_SQL = (
    "DROP TABLE IF EXISTS bench.events CASCADE",
    "CREATE TABLE bench.events AS TABLE bench.utemplate",
    "ALTER TABLE bench.events ALTER COLUMN id SET DEFAULT gen_random_uuid()",
    "ALTER TABLE bench.events ADD PRIMARY KEY (id)",
    "CREATE INDEX ON bench.events (created_at)",
    "VACUUM ANALYZE bench.events",
    "CHECKPOINT",
)
UUID_ELIGIBLE = "created_at < %(cutoff)s AND status <> 'open'"

# -- monthly partitions ----------------------------------------------------------------------------------
MONTHS = [datetime(2025, m, 1, tzinfo=timezone.utc) for m in range(8, 13)] + [
    datetime(2026, 1, 1, tzinfo=timezone.utc),
    datetime(2026, 2, 1, tzinfo=timezone.utc),
]  # six partitions: August 2025 to January 2026
PART_CUTOFF = datetime(2025, 12, 16, tzinfo=timezone.utc)  # August-November expired, December straddles
PART_TEMPLATE_SQL = """
DROP TABLE IF EXISTS bench.ptemplate;
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE bench.ptemplate AS
SELECT g::bigint AS id,
       %(lo)s::timestamptz + ((g - 1)::float / %(rows)s) * (%(hi)s::timestamptz - %(lo)s::timestamptz) AS created_at,
       CASE WHEN g %% 17 = 0 THEN 'open' ELSE 'closed' END AS status,
       repeat(md5(g::text), 6) AS payload
FROM generate_series(1, %(rows)s) g;
"""
PART_ELIGIBLE = "created_at < %(cutoff)s"


def part_copy_sql() -> tuple[str, ...]:
    partitions = tuple(
        f"CREATE TABLE bench.events_{lo:%Y_%m} PARTITION OF bench.events"
        f" FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
        for lo, hi in itertools.pairwise(MONTHS)
    )
    return (
        "DROP TABLE IF EXISTS bench.events CASCADE",
        "CREATE TABLE bench.events (id bigint NOT NULL, created_at timestamptz NOT NULL, status text, payload text)"
        " PARTITION BY RANGE (created_at)",
        *partitions,
        "INSERT INTO bench.events SELECT * FROM bench.ptemplate",
        "ALTER TABLE bench.events ADD PRIMARY KEY (id, created_at)",
        "CREATE INDEX ON bench.events (created_at)",
        "VACUUM ANALYZE bench.events",
        "CHECKPOINT",
    )


def uuid_policy() -> RetentionPolicy:
    """Key-less block chunks: ``key_column`` None, the project's defaults otherwise."""
    return RetentionPolicy(
        name="shapes_uuid",
        conn_id="retention_target",
        table="bench.events",
        timestamp_column="created_at",
        retention="1 day",
        condition="status <> 'open'",
        chunk_by="block",
        ledger_schema=LEDGER,
        schedule=None,
        retries=0,
    )


def part_policy(expired_partitions: str) -> RetentionPolicy:
    return RetentionPolicy(
        name="shapes_part",
        conn_id="retention_target",
        table="bench.events",
        timestamp_column="created_at",
        retention="1 day",
        expired_partitions=expired_partitions,
        ledger_schema=LEDGER,
        schedule=None,
        retries=0,
    )


# -- the DETACH sampler ----------------------------------------------------------------------------------
# What a partition chunk's backend runs, by partition: the DETACH, then the count and the DROP.
DETACH_SQL = (
    "SELECT query, coalesce(wait_event_type, ''), coalesce(wait_event, '') FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'"
    " AND (query ILIKE '%%DETACH PARTITION%%' OR query ILIKE 'SELECT count(*) FROM %%'"
    " OR query ILIKE 'DROP TABLE %%')"
)
_PHASES = (
    ("detach", re.compile(r"DETACH PARTITION\s+(\S+)", re.I)),
    ("count", re.compile(r"^SELECT count\(\*\) FROM\s+(\S+)$", re.I)),
    ("drop", re.compile(r"^DROP TABLE\s+(\S+)$", re.I)),
)


def _phase(query: str) -> tuple[str, str] | None:
    for phase, pattern in _PHASES:
        match = pattern.search(query.strip())
        if match:
            return phase, match.group(1).replace('"', "")
    return None


def _detach_sampler(dsn: str, interval: float, stop: Any, out: Any) -> None:
    """Per phase and partition: the span from the first to the last sample that saw it active, and the
    time between consecutive samples that both saw it waiting for a lock (lower bounds: a phase shorter
    than one interval may not be seen at all)."""
    conn = psycopg2.connect(dsn, application_name="bench-detach-sampler")
    conn.autocommit = True
    cur = conn.cursor()
    seen: dict[str, dict[str, Any]] = {}
    waiting: set[str] = set()
    out.send("started")
    last = time.perf_counter()
    while not stop.is_set():
        cur.execute(DETACH_SQL)
        rows = cur.fetchall()
        now = time.perf_counter()
        now_waiting = set()
        for query, wait_type, wait_event in rows:
            found = _phase(query)
            if found is None:
                continue
            key = f"{found[0]} {found[1]}"
            entry = seen.setdefault(key, {"first": now, "last": now, "lock_wait_ms": 0.0, "samples": 0, "waits": {}})
            entry["last"] = now
            entry["samples"] += 1
            if wait_type == "Lock":
                now_waiting.add(key)
                if key in waiting:
                    entry["lock_wait_ms"] += (now - last) * 1000
            if wait_type:
                event = f"{wait_type}:{wait_event}"
                entry["waits"][event] = entry["waits"].get(event, 0) + 1
        waiting, last = now_waiting, now
        time.sleep(interval)
    conn.close()
    for entry in seen.values():
        entry["active_ms"] = (entry.pop("last") - entry.pop("first")) * 1000
    out.send(seen)


class DetachSampler(_Sidecar):
    """Time each partition chunk's ``DETACH PARTITION``, ``count(*)`` and ``DROP TABLE`` spend active, and
    waiting for a lock (``wait_event_type = 'Lock'``: for transactions that still see the partition, or
    for a conflicting table lock), from ``pg_stat_activity``."""

    def __init__(self, dsn: str, interval: float = DETACH_SAMPLE_S) -> None:
        super().__init__(_detach_sampler, dsn, interval)


class _NoSidecar:
    result: Any = None

    def __enter__(self) -> _NoSidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# -- measuring ---------------------------------------------------------------------------------------------
Purge = Callable[[], tuple[int, dict[str, Any]]]


def setup(dsn: str, statements: Sequence[str], cutoff: datetime) -> list[Any]:
    """A fresh copy of the template as ``bench.events``; the live ids the foreground load touches."""
    admin_execute(dsn, f"DROP SCHEMA IF EXISTS {LEDGER} CASCADE")
    admin = psycopg2.connect(dsn, application_name="bench-admin")
    admin.autocommit = True
    with admin.cursor() as cur:
        for statement in statements:
            cur.execute(statement)
        cur.execute("SELECT id FROM bench.events WHERE created_at >= %s ORDER BY id LIMIT 5000", (cutoff,))
        live = [r[0] for r in cur.fetchall()]
    admin.close()
    return live


def measure(
    dsn: str,
    name: str,
    statements: Sequence[str],
    eligible: str,
    cutoff: datetime,
    purge: Purge,
    *,
    idle: bool = False,
    sample_detach: bool = False,
) -> tuple[Result, Result | None]:
    """Copy the template, then (with ``idle``) measure the foreground load alone, then run ``purge`` beside
    the foreground load, the transaction monitor and (``sample_detach``) the DETACH sampler."""
    print(f"  {name}: copying the template ...", flush=True)
    live = setup(dsn, statements, cutoff)
    idle_result = None
    if idle:
        with Foreground(dsn, live) as fg:
            time.sleep(IDLE_SECONDS)
        p50, p99 = fg.percentiles()
        idle_result = Result("idle (no purge)", IDLE_SECONDS, 0, 0.0, 0.0, 0, p50, p99, len(fg.result or []))
    print(f"  {name}: running ...", flush=True)
    admin = psycopg2.connect(dsn, application_name="bench-admin")
    admin.autocommit = True
    before = wal_lsn(admin)
    sampler = DetachSampler(dsn) if sample_detach else _NoSidecar()
    with Foreground(dsn, live) as fg, TxnMonitor(dsn, TXN_SAMPLE_S) as monitor, sampler:
        load = os.getloadavg()[0]  # the machine is shared: how busy it was when the method started
        started = time.perf_counter()
        rows, notes = purge()
        seconds = time.perf_counter() - started
    notes["load_1m"] = round(load, 2)
    wal = int(one(admin, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (before,)))
    left = one(admin, f"SELECT count(*) FROM bench.events WHERE {eligible}", {"cutoff": cutoff})
    admin.close()
    if left:
        raise AssertionError(f"{name}: {left} eligible rows left")
    if sample_detach:
        _merge_detach_samples(notes, sampler.result or {})
    p50, p99 = fg.percentiles()
    result = Result(name, seconds, rows, rows / seconds, monitor.longest, wal, p50, p99, len(fg.result or []), notes)
    return result, idle_result


def _merge_detach_samples(notes: dict[str, Any], samples: dict[str, dict[str, Any]]) -> None:
    for part in notes.get("partition_chunks", []):
        detach = samples.get(f"detach {part['partition']}", {})
        part["detach_sampled_active_ms"] = round(detach.get("active_ms", 0.0), 1)
        part["detach_lock_wait_ms"] = round(detach.get("lock_wait_ms", 0.0), 1)
        part["detach_waits"] = detach.get("waits", {})
        for phase in ("count", "drop"):
            sampled = samples.get(f"{phase} {part['partition']}", {})
            part[f"{phase}_sampled_ms"] = round(sampled.get("active_ms", 0.0), 1)
            part[f"{phase}_waits"] = sampled.get("waits", {})


def unbounded(dsn: str, eligible: str, cutoff: datetime) -> tuple[int, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute(f"DELETE FROM bench.events WHERE {eligible}", {"cutoff": cutoff})
        rows = cur.rowcount
    conn.commit()
    conn.close()
    return rows, {}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the max at q=100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def engine(dsn: str, policy: RetentionPolicy, cutoff: datetime) -> tuple[int, dict[str, Any]]:
    """The planner, then every chunk in plan order on one connection (one worker). Row batches and
    partition chunks are reported apart: a partition chunk is a detach, a count and a drop, not a batch."""
    conn = psycopg2.connect(dsn)
    started = time.perf_counter()
    plan = plan_run(conn, policy, cutoff)
    planning = time.perf_counter() - started
    rows = 0
    batch_ms: list[float] = []
    sizes: list[int] = []
    block_rows, block_s = 0, 0.0
    parts: list[dict[str, Any]] = []
    leaves: dict[str, dict[str, Any]] = {}
    for chunk in plan.chunks:
        steps: dict[str, float] = {}
        chunk_started = time.perf_counter()
        result = run_chunk(
            conn,
            policy,
            plan.cutoff,
            chunk,
            on_step=lambda step, steps=steps: steps.setdefault(step, time.perf_counter()),
        )
        ended = time.perf_counter()
        rows += result.rows_deleted
        if chunk.action is not None:
            before = steps.get("before_detach", chunk_started)
            after = steps.get("after_detach", before)
            parts.append(
                {
                    "partition": chunk.partition,
                    "outcome": result.outcome,
                    "rows": result.rows_deleted,
                    "total_ms": round((ended - chunk_started) * 1000, 1),
                    "before_detach_ms": round((before - chunk_started) * 1000, 1),
                    "detach_ms": round((after - before) * 1000, 1),
                    "count_drop_commit_ledger_ms": round((ended - after) * 1000, 1),
                }
            )
        else:
            block_rows += result.rows_deleted
            block_s += ended - chunk_started
            if chunk.partition is not None:
                leaf = leaves.setdefault(chunk.partition, {"chunks": 0, "rows": 0, "seconds": 0.0, "batches": 0})
                leaf["chunks"] += 1
                leaf["rows"] += result.rows_deleted
                leaf["seconds"] = round(leaf["seconds"] + ended - chunk_started, 3)
                leaf["batches"] += len(result.batch_log)
            batch_ms.extend(b.ms for b in result.batch_log)
            sizes.extend(b.size for b in result.batch_log)
    conn.close()
    notes: dict[str, Any] = {
        "chunks": len(plan.chunks),
        "planning_s": round(planning, 3),
        "batches": len(batch_ms),
        "batch_p50_ms": round(percentile(batch_ms, 50), 1),
        "batch_p99_ms": round(percentile(batch_ms, 99), 1),
        "batch_max_ms": round(percentile(batch_ms, 100), 1),
        "batches_over_400ms": sum(1 for ms in batch_ms if ms > 400),
        "batch_sizes_min_max": [min(sizes), max(sizes)] if sizes else [],
        "block_chunk_rows": block_rows,
        "block_chunk_s": round(block_s, 2),
    }
    if leaves:
        notes["block_chunks_by_leaf"] = leaves
    if parts:
        notes["partition_chunks"] = parts
        notes["partition_chunk_rows"] = sum(p["rows"] for p in parts)
        notes["partition_chunk_s"] = round(sum(p["total_ms"] for p in parts) / 1000, 3)
    return rows, notes


# -- the report --------------------------------------------------------------------------------------------
def print_shape(title: str, idle: Result | None, results: list[Result]) -> None:
    ref = next((r for r in results if r.method.startswith("a.")), None)
    print()
    print(title + (f"; foreground idle p50 {idle.fg_p50_ms:.2f} ms, p99 {idle.fg_p99_ms:.2f} ms" if idle else ""))
    header = (
        f"{'method':<40} {'rows':>10} {'s':>7} {'rows/s':>10} {'x(a)':>6} {'WAL MB':>7} {'x(a)':>5}"
        f" {'longest txn ms':>14} {'batch p50':>9} {'p99':>6} {'max':>6} {'fg p99':>7} {'load':>5}"
    )
    print(header)
    for r in results:
        speed = f"{r.rows_per_s / ref.rows_per_s:>6.2f}" if ref else f"{'-':>6}"
        wal = f"{r.wal_bytes / max(ref.wal_bytes, 1):>5.2f}" if ref else f"{'-':>5}"
        n = r.notes
        batches = (
            f"{n['batch_p50_ms']:>9,.0f} {n['batch_p99_ms']:>6,.0f} {n['batch_max_ms']:>6,.0f}"
            if n.get("batches")
            else f"{'-':>9} {'-':>6} {'-':>6}"
        )
        print(
            f"{r.method:<40} {r.rows:>10,} {r.seconds:>7.2f} {r.rows_per_s:>10,.0f} {speed} {r.wal_bytes / 2**20:>7.0f}"
            f" {wal} {r.longest_txn_ms:>14,.0f} {batches} {r.fg_p99_ms:>7.2f} {n.get('load_1m', 0):>5.1f}"
        )
    for r in results:
        n = r.notes
        if "chunks" not in n:
            continue
        print(
            f"  {r.method}: {n['chunks']} chunks, planning {n['planning_s']:.2f} s, {n['batches']} batches"
            f" (sizes {n['batch_sizes_min_max']}, {n['batches_over_400ms']} over 400 ms),"
            f" block chunks {n['block_chunk_rows']:,} rows in {n['block_chunk_s']:.2f} s"
        )
        for leaf, v in n.get("block_chunks_by_leaf", {}).items():
            print(
                f"    block chunks of {leaf}: {v['chunks']} chunks, {v['batches']} batches, {v['rows']:,} rows"
                f" in {v['seconds']:.2f} s"
            )
        for p in n.get("partition_chunks", []):
            print(
                f"    {p['outcome']} {p['partition']}: {p['rows']:,} rows in {p['total_ms']:,.0f} ms:"
                f" ledger {p['before_detach_ms']:,.0f}, DETACH CONCURRENTLY {p['detach_ms']:,.0f}"
                f" (sampled {p.get('detach_sampled_active_ms', 0):,.0f}, lock wait"
                f" {p.get('detach_lock_wait_ms', 0):,.0f}),"
                f" count + drop + commit + ledger {p['count_drop_commit_ledger_ms']:,.0f}"
                f" (sampled count {p.get('count_sampled_ms', 0):,.0f}, drop {p.get('drop_sampled_ms', 0):,.0f})"
            )
        if n.get("partition_chunks") and ref:
            speed = n["partition_chunk_rows"] / max(n["partition_chunk_s"], 1e-9)
            print(
                f"    partition chunks alone: {n['partition_chunk_rows']:,} rows in {n['partition_chunk_s']:.2f} s,"
                f" {speed:,.0f} rows/s = {speed / ref.rows_per_s:,.0f}x (a)'s rows/s"
            )


def run_shape(
    dsn: str,
    title: str,
    statements: Sequence[str],
    eligible: str,
    cutoff: datetime,
    methods: list[tuple[str, Purge, bool]],
) -> tuple[Result | None, list[Result], list[str]]:
    idle: Result | None = None
    results: list[Result] = []
    failed: list[str] = []
    print(title, flush=True)
    for i, (name, purge, sample_detach) in enumerate(methods):
        try:
            result, idle_result = measure(
                dsn, name, statements, eligible, cutoff, purge, idle=i == 0, sample_detach=sample_detach
            )
        except Exception as exc:  # noqa: BLE001 - reported; the other methods' numbers are kept
            print(f"  FAILED: {name}: {exc!r}", flush=True)
            failed.append(name)
            continue
        idle = idle or idle_result
        results.append(result)
    return idle, results, failed


def build(dsn: str, sql: str, params: dict[str, Any], label: str) -> float:
    print(f"building {label} ...", flush=True)
    started = time.perf_counter()
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(sql, params)
    admin.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--shapes", nargs="+", default=["uuid", "partitioned"], choices=["uuid", "partitioned"])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["a", "c", "p-drop", "p-delete"],
        choices=["a", "c", "p-drop", "p-delete"],
        help="a: unbounded DELETE (both shapes); c: block chunks (uuid); p-drop, p-delete (partitioned)",
    )
    parser.add_argument("--dsn", help=f"PostgreSQL server (a database {DB!r} is created on it and dropped)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results-shapes.json")
    args = parser.parse_args(argv)
    rows = args.rows

    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    out: dict[str, Any] = {"rows": rows}
    failed: list[str] = []
    started = time.perf_counter()
    try:
        if "uuid" in args.shapes:
            build(dsn, UUID_TEMPLATE_SQL, {"rows": rows, "cutoff": UUID_CUTOFF}, f"bench.utemplate ({rows:,} rows)")
            methods: list[tuple[str, Purge, bool]] = []
            if "a" in args.methods:
                methods.append(("a. unbounded DELETE", lambda: unbounded(dsn, UUID_ELIGIBLE, UUID_CUTOFF), False))
            if "c" in args.methods:
                methods.append(
                    ("c. planner + engine, blocks, no key", lambda: engine(dsn, uuid_policy(), UUID_CUTOFF), False)
                )
            idle, results, bad = run_shape(dsn, "uuid keys", UUID_COPY_SQL, UUID_ELIGIBLE, UUID_CUTOFF, methods)
            out["uuid"] = {"idle": asdict(idle) if idle else None, "results": [asdict(r) for r in results]}
            failed += bad
            admin_execute(dsn, "DROP TABLE IF EXISTS bench.utemplate", "DROP TABLE IF EXISTS bench.events CASCADE")
        if "partitioned" in args.shapes:
            params = {"rows": rows, "lo": MONTHS[0], "hi": MONTHS[-1]}
            build(dsn, PART_TEMPLATE_SQL, params, f"bench.ptemplate ({rows:,} rows)")
            methods = []
            if "a" in args.methods:
                methods.append(
                    ("a. unbounded DELETE on the parent", lambda: unbounded(dsn, PART_ELIGIBLE, PART_CUTOFF), False)
                )
            for mode, flag in (("drop", "p-drop"), ("delete", "p-delete")):
                if flag in args.methods:
                    methods.append(
                        (
                            f"{flag}. planner + engine, {mode}",
                            lambda mode=mode: engine(dsn, part_policy(mode), PART_CUTOFF),
                            mode == "drop",
                        )
                    )
            idle, results, bad = run_shape(dsn, "partitioned", part_copy_sql(), PART_ELIGIBLE, PART_CUTOFF, methods)
            out["partitioned"] = {"idle": asdict(idle) if idle else None, "results": [asdict(r) for r in results]}
            failed += bad
    finally:
        admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    out["total_seconds"] = round(time.perf_counter() - started, 1)

    print(f"\n{rows:,} rows per table; whole run {out['total_seconds']:.0f} s")
    for shape, title in (("uuid", "uuid keys (id uuid PRIMARY KEY)"), ("partitioned", "partitioned by month (6)")):
        if shape in out:
            data = out[shape]
            idle = Result(**data["idle"]) if data["idle"] else None
            print_shape(title, idle, [Result(**r) for r in data["results"]])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nresults written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
