"""Purge benchmark: one unbounded DELETE against the common LIMIT loop and the planner + chunk engine.

    python benchmarks/purge_benchmark.py [--rows 2000000 | --large] [--workers 1 4] [--dsn DSN] [--json out.json]

Builds a table of N rows (realistic width, primary key, an index on the timestamp and on (tenant, id),
about 60 % eligible) once, copies it before each method so every method starts from the same table, and
for each method measures: wall seconds, rows/s, the longest transaction (ms), WAL bytes written
(``pg_current_wal_lsn()`` before and after), and the p50/p99 latency of a concurrent foreground load of
single-row reads and writes on live rows (and the same load on the idle database first). Prints a table of
ratios to method (a), the unbounded DELETE, measured in the same run. Methods (d) and (e), the whole DAG
through ``dag.test()`` and under the scheduler, are not in this script yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_retention.core.engine import run_chunk
from airflow_retention.core.planner import plan_run
from airflow_retention.core.policy import RetentionPolicy
from airflow_retention.demo.postgres import admin_execute, resolve_dsn

DB = "retention_bench"
CUTOFF = datetime(2026, 1, 1, tzinfo=timezone.utc)
BATCH = 5000
TEMPLATE_SQL = """
DROP SCHEMA IF EXISTS bench CASCADE;
CREATE SCHEMA bench;
CREATE TABLE bench.template AS
SELECT g::bigint AS id,
       (g %% 50)::integer AS tenant_id,
       %(cutoff)s::timestamptz - interval '60 days' + (g::float / %(rows)s) * interval '100 days' AS created_at,
       CASE WHEN g %% 17 = 0 THEN 'open' ELSE 'closed' END AS status,
       repeat(md5(g::text), 6) AS payload
FROM generate_series(1, %(rows)s) g;
"""
COPY_SQL = (
    "DROP TABLE IF EXISTS bench.events",
    "CREATE TABLE bench.events AS TABLE bench.template",
    "ALTER TABLE bench.events ADD PRIMARY KEY (id)",
    "CREATE INDEX ON bench.events (created_at)",
    "CREATE INDEX ON bench.events (tenant_id, id)",
    "VACUUM ANALYZE bench.events",
    "CHECKPOINT",
)
ELIGIBLE = "created_at < %(cutoff)s AND status <> 'open'"


@dataclass
class Result:
    method: str
    seconds: float
    rows: int
    rows_per_s: float
    longest_txn_ms: float
    wal_bytes: int
    fg_p50_ms: float
    fg_p99_ms: float
    fg_ops: int
    notes: dict[str, Any] = field(default_factory=dict)


class Foreground:
    """Single-row reads and writes on live (never eligible) rows, as fast as one session goes."""

    def __init__(self, dsn: str, live_ids: list[int]) -> None:
        self.dsn = dsn
        self.live_ids = live_ids
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        i = 0
        while not self.stop.is_set():
            row_id = self.live_ids[i % len(self.live_ids)]
            started = time.perf_counter()
            if i % 2:
                cur.execute("UPDATE bench.events SET payload = payload WHERE id = %s", (row_id,))
            else:
                cur.execute("SELECT payload FROM bench.events WHERE id = %s", (row_id,))
                cur.fetchall()
            self.latencies.append((time.perf_counter() - started) * 1000)
            i += 1
        conn.close()

    def __enter__(self) -> Foreground:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def percentiles(self) -> tuple[float, float]:
        if len(self.latencies) < 2:
            return 0.0, 0.0
        q = statistics.quantiles(self.latencies, n=100)
        return q[49], q[98]


def one(conn: Any, sql: str, params: Any = None) -> Any:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()[0]


def wal_lsn(conn: Any) -> str:
    return one(conn, "SELECT pg_current_wal_lsn()::text")


def measure(
    dsn: str, name: str, purge: Callable[[], tuple[int, float, dict[str, Any]]], *, purges: bool = True
) -> Result:
    """Copy the template, start the foreground load, run ``purge`` (returns rows, longest txn ms, notes)."""
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        for statement in COPY_SQL:
            cur.execute(statement)
        cur.execute("SELECT id FROM bench.events WHERE created_at >= %s ORDER BY id LIMIT 5000", (CUTOFF,))
        live = [r[0] for r in cur.fetchall()]
    before = wal_lsn(admin)
    with Foreground(dsn, live) as fg:
        time.sleep(0.5)
        fg.latencies.clear()
        started = time.perf_counter()
        rows, longest, notes = purge()
        seconds = time.perf_counter() - started
    wal = int(one(admin, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (before,)))
    left = one(admin, f"SELECT count(*) FROM bench.events WHERE {ELIGIBLE}", {"cutoff": CUTOFF})
    admin.close()
    if purges and left:
        raise AssertionError(f"{name}: {left} eligible rows left")
    p50, p99 = fg.percentiles()
    return Result(name, seconds, rows, rows / seconds, longest, wal, p50, p99, len(fg.latencies), notes)


def unbounded(dsn: str) -> tuple[int, float, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    started = time.perf_counter()
    with conn.cursor() as cur:
        cur.execute(f"DELETE FROM bench.events WHERE {ELIGIBLE}", {"cutoff": CUTOFF})
        rows = cur.rowcount
    conn.commit()
    conn.close()
    return rows, (time.perf_counter() - started) * 1000, {}


def limit_loop(dsn: str) -> tuple[int, float, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    rows, longest, loops = 0, 0.0, 0
    while True:
        started = time.perf_counter()
        with conn.cursor() as cur:
            cur.execute(
                f"DELETE FROM bench.events WHERE id IN (SELECT id FROM bench.events WHERE {ELIGIBLE} LIMIT %(n)s)",
                {"cutoff": CUTOFF, "n": BATCH},
            )
            n = cur.rowcount
        conn.commit()
        longest = max(longest, (time.perf_counter() - started) * 1000)
        rows += n
        loops += 1
        if n == 0:
            break
    conn.close()
    return rows, longest, {"transactions": loops}


def engine(dsn: str, workers: int, tenants: bool = True) -> tuple[int, float, dict[str, Any]]:
    policy = RetentionPolicy(
        name="bench",
        conn_id="bench",
        table="bench.events",
        key_column="id",
        timestamp_column="created_at",
        tenant_column="tenant_id" if tenants else None,
        retention="1 day",
        condition="status <> 'open'",
        batch_size=BATCH,
        chunk_rows=100_000,
        ledger_schema="bench_ledger",
    )
    admin_execute(dsn, "DROP SCHEMA IF EXISTS bench_ledger CASCADE")
    conn = psycopg2.connect(dsn)
    started = time.perf_counter()
    plan = plan_run(conn, policy, CUTOFF)
    planning = time.perf_counter() - started
    conn.close()
    queue = list(plan.chunks)
    lock = threading.Lock()
    totals = {"rows": 0, "longest": 0.0, "batches": 0}

    def work() -> None:
        c = psycopg2.connect(dsn)
        while True:
            with lock:
                if not queue:
                    break
                chunk = queue.pop(0)
            result = run_chunk(c, policy, plan.cutoff, chunk)
            with lock:
                totals["rows"] += result.rows_deleted
                totals["batches"] += result.batches
                totals["longest"] = max(totals["longest"], *(b.ms for b in result.batch_log))
        c.close()

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (
        int(totals["rows"]),
        float(totals["longest"]),
        {"chunks": len(plan.chunks), "batches": totals["batches"], "planning_s": round(planning, 2)},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--large", action="store_true", help="10,000,000 rows")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dsn", help="PostgreSQL server (a database 'retention_bench' is recreated on it)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results.json"))
    args = parser.parse_args(argv)
    rows = 10_000_000 if args.large else args.rows

    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    print(f"building bench.template with {rows:,} rows ...", flush=True)
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(TEMPLATE_SQL, {"rows": rows, "cutoff": CUTOFF})
    admin.close()

    idle = measure(dsn, "idle (no purge)", lambda: (time.sleep(3), (0, 0.0, {}))[1], purges=False)
    methods: list[tuple[str, Callable[[], tuple[int, float, dict[str, Any]]]]] = [
        ("a. unbounded DELETE", lambda: unbounded(dsn)),
        (f"b. DELETE ... IN (SELECT ... LIMIT {BATCH}) loop", lambda: limit_loop(dsn)),
    ]
    methods += [(f"c. planner + chunk engine, {w} worker(s)", lambda w=w: engine(dsn, w)) for w in args.workers]
    methods += [("c. same, 1 worker, no tenant column", lambda: engine(dsn, 1, tenants=False))]
    results = []
    for name, purge in methods:
        print(f"running {name} ...", flush=True)
        results.append(measure(dsn, name, purge))
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    ref = results[0]
    print()
    print(
        f"{rows:,} rows, {ref.rows:,} eligible;"
        f" foreground idle p50 {idle.fg_p50_ms:.2f} ms, p99 {idle.fg_p99_ms:.2f} ms"
    )
    header = f"{'method':<44} {'s':>7} {'rows/s':>10} {'x(a)':>6} {'longest txn ms':>15} {'WAL MB':>8} {'x(a)':>6}"
    header += f" {'fg p50':>7} {'fg p99':>7} {'p99/idle':>8}"
    print(header)
    for r in results:
        print(
            f"{r.method:<44} {r.seconds:>7.1f} {r.rows_per_s:>10,.0f} {r.rows_per_s / ref.rows_per_s:>6.2f}"
            f" {r.longest_txn_ms:>15,.0f} {r.wal_bytes / 2**20:>8.0f} {r.wal_bytes / max(ref.wal_bytes, 1):>6.2f}"
            f" {r.fg_p50_ms:>7.2f} {r.fg_p99_ms:>7.2f} {r.fg_p99_ms / max(idle.fg_p99_ms, 1e-9):>8.1f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"rows": rows, "idle": asdict(idle), "results": [asdict(r) for r in results]}, indent=2)
    )
    print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
