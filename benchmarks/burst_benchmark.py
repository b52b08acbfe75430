"""The burst of WAL: at the same rows per second, how pgbench's p99 depends on the size of each batch (the
WAL one commit flushes), in one run. What ``BURST_WAL_BYTES`` (airflow_retention/core/running/pacing.py)
was chosen from.

    python benchmarks/burst_benchmark.py [--rows 3000000] [--rates 5000 15000] [--batches 250 1000 4000 16000]
                                         [--seconds 20] [--dsn DSN] [--json out.json]

In a database of its own (``retention_burst_bench``): pgbench's TPC-B tables (``pgbench -i -s 10``) and a
table of ``--rows`` rows of about 230 bytes (the budget benchmark's width). pgbench runs at 300 tps (4
clients, its latency counted from each transaction's scheduled start) while one session deletes the
table's rows in key order, ``n`` at a time, each batch its own transaction, resting between batches so that
it deletes ``rate`` rows a second: the same work, in bursts of different sizes. Each combination runs for
``--seconds`` after a ``CHECKPOINT`` (every page's first change then writes its full image, as in a purge),
in an order that interleaves sizes and rates; pgbench alone runs first and last. A timed checkpoint may still
land in one combination: the table prints the load average and the WAL written for each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from budget_benchmark import PgBench, percentiles, pgbench_init  # noqa: E402
from purge_benchmark import write_json  # noqa: E402

DATABASE = "retention_burst_bench"
TABLE_SQL = (
    "DROP TABLE IF EXISTS burst",
    "CREATE TABLE burst AS SELECT g::bigint AS id, now() AS created_at, repeat(md5(g::text), 6) AS payload"
    " FROM generate_series(1, %(rows)s) g",
    "ALTER TABLE burst ADD PRIMARY KEY (id)",
    "VACUUM ANALYZE burst",
)


def admin(dsn: str) -> Any:
    conn = psycopg2.connect(dsn, application_name="burst-admin")
    conn.autocommit = True
    return conn


def fresh_database(server_dsn: str, database: str, rows: int, extra: tuple[str, ...] = ()) -> str:
    """``database`` created afresh with pgbench's tables and the ``burst`` table of ``rows`` rows (then the
    ``extra`` statements); its DSN."""
    with closing(admin(server_dsn)) as a, a.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {database}")
        cur.execute(f"CREATE DATABASE {database}")
    dsn = make_dsn(server_dsn, dbname=database)
    pgbench_init(dsn, 10)
    print(f"building a table of {rows:,} rows ...", flush=True)
    with closing(admin(dsn)) as a, a.cursor() as cur:
        for statement in (*TABLE_SQL, *extra):
            cur.execute(statement, {"rows": rows})
    return dsn


def wal_position(cur: Any) -> int:
    cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
    return int(cur.fetchone()[0])


def purge(dsn: str, size: int, rate: float, first_id: int, stop: threading.Event, out: dict[str, Any]) -> None:
    """Delete ``size`` rows per transaction from ``first_id`` on, ``rate`` rows a second, until ``stop``."""
    conn = psycopg2.connect(dsn, application_name="burst-purge")
    conn.autocommit = True
    cur = conn.cursor()
    lo, took, wal = first_id, [], []
    while not stop.is_set():
        # The batch's WAL from just before it to just after its commit: pgbench's few writes meanwhile
        # included, not those of the rests.
        before = wal_position(cur)
        began = time.monotonic()
        cur.execute("BEGIN")
        cur.execute("DELETE FROM burst WHERE id >= %s AND id < %s", (lo, lo + size))
        cur.execute("COMMIT")
        took.append(time.monotonic() - began)
        wal.append(wal_position(cur) - before)
        lo += size
        stop.wait(max(0.0, size / rate - took[-1]))
    out.update(
        next_id=lo,
        batches=len(took),
        batch_p50_ms=round(statistics.median(took) * 1000, 2) if took else None,
        wal_mb_per_batch=round(statistics.median(wal) / 1e6, 2) if wal else None,
    )
    conn.close()


def one(dsn: str, size: int, rate: float, seconds: float, first_id: int) -> dict[str, Any]:
    """pgbench for ``seconds``, beside the purge of ``size``-row batches at ``rate`` (``size`` 0: alone)."""
    with closing(admin(dsn)) as a, a.cursor() as cur:
        cur.execute("CHECKPOINT")
    load = os.getloadavg()[0]
    out: dict[str, Any] = {"next_id": first_id}
    with tempfile.TemporaryDirectory(prefix="burst-bench-") as tmp:
        with PgBench(dsn, 300, Path(tmp)) as bench:
            time.sleep(2.5)  # pgbench's connections, left out of its latencies
            since, stop = time.time(), threading.Event()
            worker = threading.Thread(target=purge, args=(dsn, size, rate, first_id, stop, out)) if size else None
            if worker is not None:
                worker.start()
            time.sleep(seconds)
            stop.set()
            if worker is not None:
                worker.join()
            until = time.time()
            time.sleep(0.5)
        p50, p99 = percentiles(bench.latencies(since, until))
    return {"batch_rows": size, "rows_per_s": rate, "fg_p50_ms": round(p50, 2), "fg_p99_ms": round(p99, 2),
            "load": round(load, 2), **out}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--rates", type=float, nargs="+", default=[5000, 15000], help="rows deleted a second")
    parser.add_argument("--batches", type=int, nargs="+", default=[250, 1000, 4000, 16000], help="rows a batch")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--dsn", default="host=127.0.0.1 user=postgres dbname=postgres")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    needed = sum(args.rates) * args.seconds * len(args.batches)
    if needed > args.rows:
        parser.error(f"--rows {args.rows:,} is fewer than the {needed:,.0f} rows the combinations delete")
    dsn = fresh_database(args.dsn, DATABASE, args.rows)
    # Sizes interleaved (smallest, largest, next smallest, ...), each at every rate: a slow drift of the
    # machine does not line up with the size.
    sizes = sorted(args.batches)
    order = [sizes[i // 2] if i % 2 == 0 else sizes[-1 - i // 2] for i in range(len(sizes))]
    results, next_id = [one(dsn, 0, 0, args.seconds, 1)], 1
    for size in order:
        for rate in args.rates:
            results.append(one(dsn, size, rate, args.seconds, next_id))
            next_id = results[-1]["next_id"]
            print(f"  {results[-1]}", flush=True)
    results.append(one(dsn, 0, 0, args.seconds, next_id))
    alone = statistics.median([results[0]["fg_p99_ms"], results[-1]["fg_p99_ms"]])
    print(f"\npgbench alone: p99 {results[0]['fg_p99_ms']} and {results[-1]['fg_p99_ms']} ms (median {alone})")
    print(
        f"{'batch rows':>10} {'rows/s':>8} {'WAL MB/batch':>12} {'batch ms':>9} {'fg p99':>7} {'/alone':>7} {'load':>5}"
    )
    for r in sorted(results[1:-1], key=lambda r: (r["rows_per_s"], r["batch_rows"])):
        print(f"{r['batch_rows']:>10,} {r['rows_per_s']:>8,.0f} {r['wal_mb_per_batch']:>12} {r['batch_p50_ms']:>9}"
              f" {r['fg_p99_ms']:>7} {r['fg_p99_ms'] / alone:>7.2f} {r['load']:>5}")  # fmt: skip
    if args.json:
        write_json(args.json, {"rows": args.rows, "seconds": args.seconds, "alone_p99_ms": alone, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
