"""Pacing benchmark: batch transaction times through checkpoints, and the foreground's latency under each
``max_duty_cycle`` and ``wal_compression``, side by side with one unbounded DELETE, in one run.

    python benchmarks/pacing_benchmark.py [--rows N | --large] [--duty 1 0.5 0.25] [--wal-compression server lz4]
                                          [--payload repeated|json|random] [--checkpoint-every 2] [--repeat 3]
                                          [--monitor-ms 5]
                                          [--dsn DSN] [--json out.json]

Uses the table, the copy before every run, the foreground load (500 single-row reads and writes a second
on live rows, in a process of its own) and the transaction monitor of ``purge_benchmark.py``, in a
database of its own (``retention_pacing_bench``). Each engine run is the planner and then its chunks on one
worker, with the project's defaults (block chunks, adaptive batches aiming at ``target_batch_time``
200 ms, chunks sized by time) and the given ``max_duty_cycle`` and ``wal_compression``; the unbounded
DELETE is also measured with its session's ``wal_compression`` set to the first compressing method given.
Per run it prints the wall time and its ratio to the unbounded DELETE, the WAL written (the whole
server's), the committed batch transactions' p50/p99/max in ms (measured by the engine around each batch
transaction) and the max over the target, the batches the statement cap cut short, the longest writing
transaction sampled from ``pg_stat_activity`` every 5 ms (cut batches included), the checkpoints that ran
(``pg_stat_bgwriter``), and the foreground's mean and p99 against idle. The 5 ms sampling takes enough
CPU of a 2-core machine to slow the foreground while a purge takes the other core: measure the
foreground with ``--monitor-ms 500``.

Checkpoints: at 10,000,000 rows the purge writes about 1.8 GB of WAL, past Debian's default
``max_wal_size`` of 1 GB, so checkpoints start mid-purge on their own. A smaller table (or a server with
a larger ``max_wal_size``) sees none: ``--checkpoint-every S`` adds a run whose side connection issues
``CHECKPOINT`` every S seconds, to simulate them (an immediate checkpoint, which no watch can foresee:
that run shows the statement cap and the controller alone). The server's settings are never changed.
``--payload`` picks the payload column's contents (``purge_benchmark.PAYLOADS``): how well the pages
compress decides what ``wal_compression`` saves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import purge_benchmark as pb  # noqa: E402

from airflow_retention.core.planning.planner import plan_run  # noqa: E402
from airflow_retention.core.policy.loading import policy_to_dict  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running.engine import run_chunk  # noqa: E402
from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

DB = "retention_pacing_bench"


def policy_with(**fields: Any) -> RetentionPolicy:
    return RetentionPolicy.from_dict({**policy_to_dict(pb.bench_policy()), **fields})


def checkpoints(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter")
        return int(cur.fetchone()[0])


class Checkpointer:
    """A side connection that issues ``CHECKPOINT`` every ``every`` seconds while the purge runs."""

    def __init__(self, dsn: str, every: float | None) -> None:
        self.dsn, self.every = dsn, every
        self.stop = threading.Event()
        self.issued = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = psycopg2.connect(self.dsn, application_name="bench-checkpoint")
        conn.autocommit = True
        while not self.stop.wait(self.every):
            with conn.cursor() as cur:
                cur.execute("CHECKPOINT")
            self.issued += 1
        conn.close()

    def __enter__(self) -> Checkpointer:
        if self.every:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.every:
            self.thread.join()


def compressed_delete(dsn: str, method: str) -> tuple[int, dict[str, Any]]:
    """The unbounded DELETE with its full-page images compressed (the session's wal_compression)."""
    return pb.unbounded(make_dsn(dsn, options=f"-c wal_compression={method}"))


def engine(dsn: str, policy: RetentionPolicy, checkpoint_every: float | None = None) -> tuple[int, dict[str, Any]]:
    """Plan, then run every chunk on one worker; the batch times come from the engine's reports."""
    conn = psycopg2.connect(dsn)
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    before = checkpoints(admin)
    batch_ms: list[float] = []
    totals = {"rows": 0, "cut": 0, "duty_s": 0.0}
    with Checkpointer(dsn, checkpoint_every) as side:
        plan = plan_run(conn, policy, pb.CUTOFF)
        for chunk in plan.chunks:
            result = run_chunk(conn, policy, plan.cutoff, chunk, on_batch=lambda b: batch_ms.append(b.ms))
            totals["rows"] += result.rows_deleted
            totals["cut"] += result.batches_cut
            totals["duty_s"] += result.duty_seconds
    ran = checkpoints(admin) - before
    conn.close()
    admin.close()
    q = statistics.quantiles(batch_ms, n=100, method="inclusive") if len(batch_ms) > 1 else [batch_ms[0]] * 99
    return int(totals["rows"]), {
        "chunks": len(plan.chunks),
        "chunk_count_why": plan.sizing.reason if plan.sizing else None,
        "batches": len(batch_ms),
        "batches_cut": totals["cut"],
        "batch_p50_ms": round(q[49], 1),
        "batch_p99_ms": round(q[98], 1),
        "batch_max_ms": round(max(batch_ms), 1),
        "checkpoints": ran,
        "checkpoints_issued": side.issued,
        "duty_pause_s": round(totals["duty_s"], 2),
    }


def combined(results: list[pb.Result]) -> pb.Result:
    """One configuration's repetitions as one row: the median of each time and latency, the worst batch
    and the longest transaction of all (a bound must hold in every run), the runs' own values in notes."""
    if len(results) == 1:
        return results[0]

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    first = results[0]
    notes = dict(first.notes)
    if "batches" in notes:
        notes.update(
            batches=round(median([r.notes["batches"] for r in results])),
            batches_cut=max(r.notes["batches_cut"] for r in results),
            batch_p50_ms=median([r.notes["batch_p50_ms"] for r in results]),
            batch_p99_ms=median([r.notes["batch_p99_ms"] for r in results]),
            batch_max_ms=max(r.notes["batch_max_ms"] for r in results),
            checkpoints=round(median([r.notes["checkpoints"] for r in results])),
        )
    notes["runs"] = [
        {"s": round(r.seconds, 2), "fg_p99_ms": round(r.fg_p99_ms, 2), "fg_mean_ms": round(r.fg_mean_ms, 3)}
        for r in results
    ]
    seconds = median([r.seconds for r in results])
    return replace(
        first,
        seconds=seconds,
        rows_per_s=first.rows / seconds if seconds else 0.0,
        longest_txn_ms=max(r.longest_txn_ms for r in results),
        wal_bytes=round(median([r.wal_bytes for r in results])),
        fg_p50_ms=median([r.fg_p50_ms for r in results]),
        fg_p99_ms=median([r.fg_p99_ms for r in results]),
        fg_mean_ms=median([r.fg_mean_ms for r in results]),
        fg_ops=sum(r.fg_ops for r in results),
        notes=notes,
    )


def print_table(rows: int, target_ms: int, idle: pb.Result, results: list[pb.Result]) -> None:
    ref = results[0]
    print()
    print(
        f"{rows:,} rows, {ref.rows:,} eligible; target_batch_time {target_ms} ms;"
        f" foreground idle p50 {idle.fg_p50_ms:.2f} ms, p99 {idle.fg_p99_ms:.2f} ms, mean {idle.fg_mean_ms:.2f} ms"
    )
    print(
        f"{'run':<44} {'s':>6} {'x(a)':>5} {'WAL MB':>7} {'batches':>7} {'cut':>4} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'max ms':>7} {'max/tgt':>7} {'txn ms':>7} {'ckpts':>5} {'fg mean':>7} {'fg p99':>7} {'p99/idle':>8}"
    )
    for r in results:
        n = r.notes
        batches = n.get("batches")
        print(
            f"{r.method:<44} {r.seconds:>6.1f} {ref.seconds / r.seconds:>5.2f} {r.wal_bytes / 2**20:>7.0f}"
            + (
                f" {batches:>7} {n['batches_cut']:>4} {n['batch_p50_ms']:>7.0f} {n['batch_p99_ms']:>7.0f}"
                f" {n['batch_max_ms']:>7.0f} {n['batch_max_ms'] / target_ms:>7.2f}"
                if batches
                else f" {'':>7} {'':>4} {'':>7} {'':>7} {'':>7} {'':>7}"
            )
            + f" {r.longest_txn_ms:>7.0f} {n.get('checkpoints', ''):>5} {r.fg_mean_ms:>7.2f} {r.fg_p99_ms:>7.2f}"
            f" {r.fg_p99_ms / max(idle.fg_p99_ms, 1e-9):>8.1f}"
        )
    for r in results:
        if r.notes.get("chunk_count_why"):
            print(f"  {r.method}: {r.notes['chunks']} chunk(s): {r.notes['chunk_count_why']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--large", action="store_true", help="10,000,000 rows")
    parser.add_argument("--duty", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="max_duty_cycle values")
    parser.add_argument(
        "--wal-compression",
        nargs="+",
        default=["server", "lz4"],
        help="wal_compression values of the engine runs (each with every --duty); a DELETE with the first"
        " compressing one is measured too",
    )
    parser.add_argument("--payload", choices=sorted(pb.PAYLOADS), default="repeated", help="the payload column")
    parser.add_argument("--checkpoint-every", type=float, default=None, help="also run with CHECKPOINT every S seconds")
    parser.add_argument("--repeat", type=int, default=1, help="run every configuration this many times (medians)")
    parser.add_argument(
        "--monitor-ms",
        type=float,
        default=5.0,
        help="the transaction monitor's sampling interval: 5 ms sees every batch, and takes enough CPU of a"
        " 2-core machine to slow the foreground during a purge; 500 for the foreground's numbers",
    )
    parser.add_argument("--dsn", help="PostgreSQL server (a database 'retention_pacing_bench' is recreated on it)")
    parser.add_argument("--json", type=Path, default=BENCH / "results-pacing.json")
    args = parser.parse_args(argv)
    rows = 10_000_000 if args.large else args.rows
    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    # Every 5 ms by default (not 20): the batches measured here last 200-400 ms.
    pb.TxnMonitor.__init__.__defaults__ = (args.monitor_ms / 1000,)
    target_ms = policy_with().target_batch_ms
    results: list[pb.Result] = []
    try:
        pb.build_template(dsn, rows, payload=args.payload)
        idles = [pb.measure(dsn, "idle (no purge)", lambda: (time.sleep(5), (0, {}))[1], purges=False)]
        runs: list[tuple[str, pb.Purge]] = [("a. unbounded DELETE", lambda: pb.unbounded(dsn))]
        methods = [m for m in args.wal_compression if m not in ("server", "off", "auto")]
        if methods:
            runs.append((f"a. DELETE, wal_compression {methods[0]}", lambda: compressed_delete(dsn, methods[0])))
        for wal in args.wal_compression:
            for duty in args.duty:
                policy = policy_with(max_duty_cycle=duty, wal_compression=wal)
                name = f"engine, duty {duty:g}" + ("" if wal == "server" else f", wal_compression {wal}")
                runs.append((name, lambda p=policy: engine(dsn, p)))
        if args.checkpoint_every:
            runs.append(
                (
                    f"engine, duty 1, CHECKPOINT every {args.checkpoint_every:g} s",
                    lambda: engine(dsn, policy_with(), args.checkpoint_every),
                )
            )
        measured: dict[str, list[pb.Result]] = {name: [] for name, _ in runs}
        for rep in range(args.repeat):  # each repetition runs every configuration: a load change hits all alike
            for name, purge in runs:
                which = f" ({rep + 1}/{args.repeat})" if args.repeat > 1 else ""
                print(f"running {name}{which} ...", flush=True)
                measured[name].append(pb.measure(dsn, name, purge))
            idles.append(pb.measure(dsn, "idle (no purge)", lambda: (time.sleep(5), (0, {}))[1], purges=False))
        results = [combined(rs) for rs in measured.values()]
        idle = combined(idles)
    finally:
        admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    print_table(rows, target_ms, idle, results)
    pb.write_json(
        args.json,
        {"rows": rows, "target_batch_ms": target_ms, "idle": asdict(idle), "results": [asdict(r) for r in results]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
