"""What a batch costs the application's transactions that meet it: its CPU or its WAL. In one run, pgbench
beside bursts of three kinds at the same duty cycle, each about as long as a purge's batch.

    python benchmarks/overlap_benchmark.py [--rows 4000000] [--blocks 128] [--duty 0.01 [0.0025 ...]]
                                           [--kinds delete cpu wal flushed budget] [--budget-workers N]
                                           [--seconds 60] [--none-seconds 40] [--dsn DSN] [--json out.json]

In a database of its own (``retention_overlap_bench``): pgbench's TPC-B tables (``pgbench -i -s 10``) and a
table of ``--rows`` rows of about 230 bytes (the budget benchmark's width). pgbench runs at 300 tps (4
clients, its latency counted from each transaction's scheduled start) through the whole run, while one
session makes bursts, resting after each so that bursts take ``--duty`` of the time, as the database
budget's floor does:

- ``delete``: a purge's batch, ``--blocks`` blocks deleted by a TID range with a one-row ledger update, in
  one transaction;
- ``cpu``: CPU only, ``count(*)`` over ``generate_series``, sized at the start to last as long as a
  ``delete`` burst;
- ``wal``: WAL only, a 1 MB ``pg_logical_emit_message`` in a transaction (about a purge batch's WAL at the
  floor, ``BURST_WAL_BYTES``);
- ``flushed`` (only when asked for): the ``delete`` burst with ``backend_flush_after = 256kB`` for its
  transaction, so that the dirty pages its session writes out are handed to the disk at once instead of
  left to the kernel's writeback: does the purge's write-back slow the transactions that meet no batch?
- ``budget`` (with ``--budget-workers N``): the database budget's own work with no batch at all: N
  threads, each a worker at the floor with empty batches (the real ``SharedBudget``: take a batch slot,
  rest as at ``--duty`` with a batch of the ``delete`` burst's length, give the slot back), so the
  observer's canaries, signals and observations and the workers' slot traffic, and nothing else. Its
  "bursts" are the observations.

Phases of ``--seconds`` each, every kind twice in a mirrored order (delete, cpu, wal, then wal, cpu,
delete), with phases of nothing (``none``, ``--none-seconds``) first, between and last: their pooled p99 is
the reference, and a transaction over 1.5 times it is slow. With several ``--duty`` values every kind runs
at each (a phase is named ``delete@0.25%``). For each phase the table shows the share of pgbench's
transactions that met a burst, how many of those were slow, and their mean latency above the reference's
median, beside the slow share of the transactions that met none. A phase in which the machine
stalled (its p99 far above every other's) says so by itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg2

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from budget_benchmark import PgBench, percentiles  # noqa: E402
from burst_benchmark import admin, fresh_database  # noqa: E402
from purge_benchmark import write_json  # noqa: E402

from airflow_retention.core.ledger.ledger import Ledger  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running.budget import SharedBudget, purge_session  # noqa: E402

DATABASE = "retention_overlap_bench"
KINDS = ("delete", "cpu", "wal")
# Burst kinds run only when asked for (--kinds).
EXTRA_KINDS = ("flushed",)
SLOW = 1.5  # times the reference's p99
SETTLE_S = 2.0  # the first seconds of each phase belong to the one before
LEDGER_SQL = (
    "DROP TABLE IF EXISTS burst_ledger",
    "CREATE TABLE burst_ledger (id integer PRIMARY KEY, rows bigint NOT NULL)",
    "INSERT INTO burst_ledger VALUES (1, 0)",
    "CHECKPOINT",
)


class Bursts:
    """One session's bursts of each kind."""

    def __init__(self, dsn: str, blocks: int) -> None:
        self.conn = psycopg2.connect(dsn, application_name="overlap-bursts")
        self.conn.autocommit = True
        self.cur = self.conn.cursor()
        self.blocks, self.block, self.series = blocks, 0, 100_000

    def delete(self, flush: bool = False) -> None:
        cur = self.cur
        cur.execute("BEGIN")
        if flush:
            cur.execute("SELECT set_config('backend_flush_after', '256kB', true)")
        cur.execute(
            "DELETE FROM burst WHERE ctid >= %s::tid AND ctid < %s::tid",
            (f"({self.block},0)", f"({self.block + self.blocks},0)"),
        )
        cur.execute("UPDATE burst_ledger SET rows = rows + %s::bigint WHERE id = 1", (cur.rowcount,))
        cur.execute("COMMIT")
        self.block += self.blocks

    def flushed(self) -> None:
        self.delete(flush=True)

    def cpu(self) -> None:
        self.cur.execute("SELECT count(*) FROM generate_series(1, %s::bigint)", (self.series,))

    def wal(self) -> None:
        self.cur.execute("BEGIN")
        self.cur.execute("SELECT pg_logical_emit_message(true, 'overlap-bench', repeat('x', 1048576))")
        self.cur.execute("COMMIT")

    def calibrate(self) -> float:
        """Size the CPU burst to a delete burst's median duration (ms, returned)."""
        deletes = [_timed(self.delete) for _ in range(5)]
        target = statistics.median(deletes)
        cpu = statistics.median(_timed(self.cpu) for _ in range(3))
        self.series = max(1_000, int(self.series * target / cpu))
        return target

    def run(self, kind: str, seconds: float, duty: float) -> list[tuple[float, float]]:
        """Bursts of ``kind`` for ``seconds``, each followed by a rest that keeps them at ``duty``:
        their (start, end) in epoch seconds."""
        burst: Callable[[], None] = getattr(self, kind)
        spans: list[tuple[float, float]] = []
        until = time.time() + seconds
        while time.time() < until:
            began = time.time()
            ms = _timed(burst)
            spans.append((began, began + ms / 1000))
            time.sleep(ms / 1000 * (1 / duty - 1))
        return spans


class Bookkeeping:
    """``workers`` threads doing what the budget does around a floor's batches, with no batch."""

    def __init__(self, dsn: str, workers: int) -> None:
        self.dsn, self.workers = dsn, workers
        self.policy = RetentionPolicy.from_dict(
            {
                "name": "overlap",
                "conn_id": "overlap",
                "table": "public.burst",
                "key_column": "id",
                "timestamp_column": "created_at",
                "retention": "1 day",
                "ledger_schema": "overlap_ledger",
            }
        )
        self.ledger = Ledger(self.policy.ledger_schema)
        with closing(admin(dsn)) as conn:
            self.ledger.ensure(conn)

    def run(self, seconds: float, duty: float, batch_ms: float) -> list[tuple[float, float]]:
        """The workers for ``seconds``: the (start, end) of every observation, in epoch seconds."""
        spans: list[tuple[float, float]] = []
        until = time.time() + seconds
        rest = batch_ms / 1000 * (1 / duty - 1)

        def worker(n: int) -> None:
            conn = psycopg2.connect(self.dsn, application_name="overlap-budget")
            conn.autocommit = True
            budget = SharedBudget(self.policy, self.ledger, f"worker {n}", f"overlap {n}")
            observe = budget._observe

            def timed_observe(*a: Any) -> Any:
                began = time.time()
                try:
                    return observe(*a)
                finally:
                    spans.append((began, time.time()))

            budget._observe = timed_observe  # type: ignore[method-assign]
            with closing(conn), purge_session(conn, self.ledger, self.policy):
                while time.time() < until:
                    budget.admit(conn)
                    time.sleep(rest)
                    budget.release(conn)
                    budget.take()

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(spans)


def _timed(burst: Callable[[], None]) -> float:
    began = time.perf_counter()
    burst()
    return (time.perf_counter() - began) * 1000


def phase_stats(
    transactions: list[tuple[float, float]], spans: list[tuple[float, float]], reference: tuple[float, float]
) -> dict[str, Any]:
    """One phase's latencies against the reference (p50, p99): p99, slow share, and the transactions
    that met a burst (a transaction spans its latency back from its completion)."""
    ref_p50, ref_p99 = reference
    slow = SLOW * ref_p99
    latencies = [ms for _, ms in transactions]
    p50, p99 = percentiles(latencies)
    out: dict[str, Any] = {
        "transactions": len(latencies),
        "fg_p50_ms": round(p50, 3),
        "fg_p99_ms": round(p99, 3),
        "p99_vs_reference": round(p99 / ref_p99, 2) if ref_p99 else None,
        "slow_share": round(sum(ms > slow for ms in latencies) / max(1, len(latencies)), 4),
    }
    if spans:
        starts = [s for s, _ in spans]
        met, other = [], []
        for at, ms in transactions:
            i = bisect_left(starts, at)  # bursts that started before the transaction ended
            (met if i and spans[i - 1][1] > at - ms / 1000 else other).append(ms)
        durations = sorted((e - s) * 1000 for s, e in spans)
        out.update(
            bursts=len(spans),
            burst_p50_ms=round(statistics.median(durations), 2),
            burst_max_ms=round(durations[-1], 1),
            busy_share=round(sum(durations) / 1000 / max(1e-9, spans[-1][1] - spans[0][0]), 4),
            met_share=round(len(met) / max(1, len(transactions)), 4),
            met_slow_share=round(sum(ms > slow for ms in met) / len(met), 3) if met else None,
            met_added_ms=round(statistics.mean(met) - ref_p50, 2) if met else None,
            other_slow_share=round(sum(ms > slow for ms in other) / max(1, len(other)), 4),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--blocks", type=int, default=128, help="blocks of each delete burst")
    parser.add_argument("--duty", type=float, nargs="+", default=[0.01], help="share(s) of the time in bursts")
    parser.add_argument("--seconds", type=float, default=60, help="seconds of each burst phase")
    parser.add_argument("--none-seconds", type=float, default=40, help="seconds of each phase of nothing")
    parser.add_argument(
        "--budget-workers", type=int, default=0, help="add budget phases: this many workers' budget, no batches"
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=(*KINDS, *EXTRA_KINDS, "budget"),
        help="burst kinds (default: delete cpu wal, and budget with --budget-workers)",
    )
    parser.add_argument("--dsn", default="host=127.0.0.1 user=postgres dbname=postgres")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for duty in args.duty:
        if not 0 < duty < 1:
            parser.error(f"--duty: a share of the time between 0 and 1, got {duty}")
    dsn = fresh_database(args.dsn, DATABASE, args.rows, LEDGER_SQL)
    with closing(admin(dsn)) as a, a.cursor() as cur:
        cur.execute("SELECT pg_relation_size('burst') / current_setting('block_size')::bigint")
        blocks = int(cur.fetchone()[0])
    bursts = Bursts(dsn, args.blocks)
    delete_ms = bursts.calibrate()
    print(f"a delete burst of {args.blocks} blocks: {delete_ms:.1f} ms; CPU burst: generate_series({bursts.series:,})")
    kinds = tuple(args.kinds or (*KINDS, *(("budget",) if args.budget_workers else ())))
    if "budget" in kinds and args.budget_workers < 1:
        parser.error("--kinds budget: needs --budget-workers N")
    books = Bookkeeping(dsn, args.budget_workers) if "budget" in kinds else None
    # (kind, duty): every kind at every duty, mirrored.
    bursting = [(kind, duty) for duty in args.duty for kind in kinds]
    phases: list[tuple[str, float, float]] = [("none", 0.0, args.none_seconds)]
    for kind, duty in (*bursting, ("none", 0.0), *reversed(bursting), ("none", 0.0)):
        phases.append((kind, duty, args.none_seconds if kind == "none" else args.seconds))
    # Blocks the delete phases take (none without them).
    deleting = sum(kind in kinds for kind in ("delete", "flushed"))
    needed = deleting * args.blocks * 2 * args.seconds * sum(args.duty) * 1000 / max(delete_ms, 0.1)
    if bursts.block + needed > blocks:
        parser.error(f"--rows {args.rows:,}: {blocks:,} blocks, about {needed:,.0f} more needed at this duty")
    marks: list[tuple[str, float, float, list[tuple[float, float]]]] = []

    def named(kind: str, duty: float) -> str:
        return kind if kind == "none" or len(args.duty) == 1 else f"{kind}@{duty:.2%}"

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        with PgBench(dsn, 300, Path(tmp)) as bench:
            time.sleep(2.5)  # pgbench's connections, left out of its latencies
            for kind, duty, seconds in phases:
                began = time.time()
                if kind == "budget":
                    assert books is not None
                    spans = books.run(seconds, duty, delete_ms)
                else:
                    spans = [] if kind == "none" else bursts.run(kind, seconds, duty)
                if kind == "none":
                    time.sleep(seconds)
                marks.append((named(kind, duty), began, time.time(), spans))
                print(f"  {named(kind, duty)}: {len(spans)} bursts", flush=True)
            time.sleep(0.5)
        log = bench.log()
    bursts.conn.close()

    def within(lo: float, hi: float) -> list[tuple[float, float]]:
        return [(at, ms) for at, ms in log if lo + SETTLE_S <= at <= hi]

    reference = percentiles([ms for kind, lo, hi, _ in marks if kind == "none" for _, ms in within(lo, hi)])
    results = [{"phase": kind, **phase_stats(within(lo, hi), spans, reference)} for kind, lo, hi, spans in marks]
    print(
        f"\npgbench with no bursts (pooled): p50 {reference[0]:.2f} ms, p99 {reference[1]:.2f} ms;"
        f" slow: over {SLOW * reference[1]:.2f} ms. Bursts at {', '.join(f'{d:g}' for d in args.duty)} of the time;"
        f" load {load:.1f}"
    )
    print(
        f"{'phase':<14} {'burst ms':>8} {'p99':>7} {'/ref':>5} {'slow':>6} {'met':>6} {'met slow':>8} {'met +ms':>7}"
        f" {'others slow':>11}"
    )
    for r in results:
        met = (
            f"{r['burst_p50_ms']:>8} {r['fg_p99_ms']:>7} {r['p99_vs_reference']:>5} {r['slow_share']:>6.2%}"
            f" {r['met_share']:>6.2%} {r['met_slow_share'] or 0:>8.0%} {r['met_added_ms'] or 0:>7}"
            f" {r['other_slow_share']:>11.2%}"
            if "bursts" in r
            else f"{'':>8} {r['fg_p99_ms']:>7} {r['p99_vs_reference']:>5} {r['slow_share']:>6.2%}"
        )
        print(f"{r['phase']:<14} {met}")
    if args.json:
        write_json(
            args.json,
            {
                "rows": args.rows,
                "blocks": args.blocks,
                "budget_workers": args.budget_workers,
                "duty": args.duty,
                "delete_ms": round(delete_ms, 2),
                "cpu_series": bursts.series,
                "load": round(load, 2),
                "reference": {"fg_p50_ms": round(reference[0], 3), "fg_p99_ms": round(reference[1], 3)},
                "results": results,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
