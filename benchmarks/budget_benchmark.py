"""Database budget benchmark: two foregrounds (pgbench at a fixed rate, and the light single-row load of
``purge_benchmark.py``), each alone and beside each purge case, the purge cases' wall times beside one
unbounded DELETE, on a busy and on an idle database, and a step load, in one run.

    python benchmarks/budget_benchmark.py [--rows N | --large] [--foregrounds pgbench light]
                                          [--pgbench-rate 300] [--pgbench-clients 4] [--pgbench-scale 10]
                                          [--workers 1 4] [--chunks 8] [--alone-s 15]
                                          [--step-rates 100 600] [--step-at 8 28] [--step-copies 3]
                                          [--skip-step | --only-step]
                                          [--chart docs/img/budget-step-load.png] [--verbose]
                                          [--set FIELD=VALUE ...] [--variant FIELD=VALUE[,...] ...]
                                          [--dsn DSN] [--json out.json]
    python benchmarks/budget_benchmark.py --markdown results.json   # the JSON as docs/performance.md's table

In a database of its own (``retention_budget_bench``): the table, its copy before every run and the
light foreground (500 single-row reads and writes a second on live rows, in a process of its own) of
``purge_benchmark.py``, and pgbench's TPC-B tables (``pgbench -i`` at ``--pgbench-scale``). pgbench runs
at a fixed rate (``-R``, 4 clients) with its per-transaction log (``-l``): with ``-R`` the latency it
logs counts from each transaction's scheduled start, so a transaction held behind a slow one counts its
wait, as an application's request would. Its first second (connections) is left out.

The purge cases, each on a fresh copy of the table:

- ``a`` one unbounded ``DELETE``: the reference of every ratio;
- ``b`` the chunk engine with the defaults before the budget (``budget: false``) on 1 and 4 workers;
- ``c`` the new defaults (the budget on) on 1 worker;
- ``d`` the new defaults on 4 workers.

Every engine case plans the run once, in ``--chunks`` chunks (``chunk_rows`` = eligible rows / chunks,
so that 4 workers have chunks to share), then runs ``run_chunk`` in that many processes, each with its
own connection, taking the next chunk of the same planned run as it finishes one: as Airflow's worker
slots run the mapped chunk tasks. For each foreground: its p50/p99 alone (before and after the cases,
median), then during each case, and the ratio, also against each alone window by itself (how far the
ratio moves with a reference that moves on a shared machine). Then the same cases with no foreground (the idle
database): a purge under the budget must not cost speed when nobody is there.

``--set wal_compression=lz4`` (any policy field, YAML spelling, several allowed) changes the new defaults of
``c``, ``d`` and the step load, and is written into their names and the JSON; ``--variant
wal_compression=lz4`` runs ``c`` and ``d`` once more with it, beside the plain ones in the same run. A
field ``pacing.NAME`` sets a constant of the engine's pacing module in the workers of ``c`` and ``d``
instead (not the step load's): ``--variant pacing.BURST_WAL_BYTES=262144`` A/B-tests a smaller WAL burst.

The step load (``--skip-step`` leaves it out): the new defaults on 4 workers, while pgbench runs at the
first ``--step-rates`` value, a second pgbench adds the difference from ``--step-at``'s first second
of the purge to its second, on a table of ``--step-copies`` times the rows (so that the purge outlasts the
step and shows the budget coming back up). It reads ``<ledger>.budget_observations`` for the purge's span and draws a
chart (``--chart``, needs matplotlib: the ``bench`` extra) of the foreground's per-second p99, the budget's
allowed concurrency and duty cycle, and the rows deleted per second, and checks the controller: its first
step down after the rise and its first step up after the fall, the largest move between two
observations, and the reversals.

Where pgbench's tail comes from (``timeline.py``): every pgbench case also counts, over 1.5x its p99 alone
and over 4, 8, 16 and 50 ms, the slow transactions that overlapped one of the purge's batches, a
checkpoint (from the server's log), both or neither, beside all transactions of each kind; and the
server's WAL and disk writes per 10 s. A cause whose transactions are slow far more often than the
others' is the tail.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg2
import yaml
from psycopg2.extensions import make_dsn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import purge_benchmark as pb  # noqa: E402
import timeline  # noqa: E402

from airflow_retention.core.ledger.ledger import Ledger  # noqa: E402
from airflow_retention.core.planning.planner import plan_run  # noqa: E402
from airflow_retention.core.policy.loading import policy_to_dict  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running import pacing  # noqa: E402
from airflow_retention.core.running.controller import ladder  # noqa: E402
from airflow_retention.core.running.engine import run_chunk  # noqa: E402
from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

# A database of its own, recreated; RETENTION_BUDGET_BENCH_DB lets two runs go side by side.
DB = os.environ.get("RETENTION_BUDGET_BENCH_DB", "retention_budget_bench")
PGBENCH = os.environ.get("PGBENCH", "/usr/bin/pgbench")
WARMUP_S = 1.0  # pgbench's first second: its connections, left out of its latencies
WARMUP_ALONE_S = 30.0  # the discarded first measurement: long enough for the first reads of each table
ELIGIBLE_SHARE = 0.56  # of the table's rows (purge_benchmark's table), for chunk_rows
# Besides 1.5x the foreground's p99 alone: where the slow transactions of several sizes come from.
TAIL_THRESHOLDS_MS = (4.0, 8.0, 16.0, 50.0)
PGBENCH_RESET = ("VACUUM pgbench_branches, pgbench_tellers", "TRUNCATE pgbench_history")


def policy_with(**fields: Any) -> RetentionPolicy:
    return RetentionPolicy.from_dict({**policy_to_dict(pb.bench_policy()), **fields})


@dataclass
class Result:
    case: str
    foreground: str  # "pgbench", "light" or "none"
    seconds: float
    rows: int
    rows_per_s: float
    wal_bytes: int
    fg_p50_ms: float = 0.0
    fg_p99_ms: float = 0.0
    fg_ops: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


# -- pgbench ------------------------------------------------------------------------------------------


class PgBench:
    """pgbench's TPC-B at ``rate`` transactions a second, with its per-transaction log in ``log_dir``.

    Stopped with SIGINT: the log's last few lines (its stdio buffer) may be lost, which only shortens the
    tail after the measured span.
    """

    def __init__(
        self, dsn: str, rate: float, log_dir: Path, *, clients: int = 4, seconds: int = 36_000, name: str = "fg"
    ) -> None:
        self.dsn, self.rate, self.clients, self.seconds = dsn, rate, clients, seconds
        self.prefix = log_dir / f"pgbench-{name}"
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> PgBench:
        self.started = time.time()
        self.process = subprocess.Popen(
            [
                PGBENCH,
                "-n",  # no vacuum of its own: each run starts from PGBENCH_RESET
                f"-c{self.clients}",
                f"-j{min(self.clients, 2)}",
                f"-R{self.rate:g}",
                f"-T{self.seconds}",
                "-l",
                f"--log-prefix={self.prefix}",
                self.dsn,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Started from a shell's background job, this process ignores SIGINT and pgbench would inherit
            # that: it is stopped with SIGINT.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        _, err = self.process.communicate(timeout=60)
        if self.process.returncode not in (0, -signal.SIGINT, 2) and err:
            print(f"  pgbench: {err.decode(errors='replace').strip()[-500:]}", flush=True)

    def __enter__(self) -> PgBench:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> list[tuple[float, float]]:
        """(completed at, epoch seconds; latency from the scheduled start, ms) of every logged transaction."""
        out = []
        for path in self.prefix.parent.glob(f"{self.prefix.name}.*"):
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split()
                # client_id transaction_no time script_no time_epoch time_us [schedule_lag]
                if len(parts) < 6 or parts[2] == "skipped":
                    continue
                try:
                    out.append((int(parts[4]) + int(parts[5]) / 1e6, int(parts[2]) / 1000))
                except ValueError:  # a line cut short by SIGINT
                    continue
        return sorted(out)

    def latencies(self, since: float, until: float) -> list[float]:
        return [ms for at, ms in self.log() if since <= at <= until and at >= self.started + WARMUP_S]


def pgbench_init(dsn: str, scale: int) -> None:
    print(f"pgbench -i at scale {scale} ...", flush=True)
    subprocess.run([PGBENCH, "-i", "-q", f"-s{scale}", dsn], check=True, capture_output=True)


def percentiles(latencies: list[float]) -> tuple[float, float]:
    if len(latencies) < 2:
        return 0.0, 0.0
    q = statistics.quantiles(latencies, n=100)
    return q[49], q[98]


# -- the purges ---------------------------------------------------------------------------------------

Purge = Callable[[], tuple[int, dict[str, Any]]]


def _worker(
    dsn: str,
    policy: RetentionPolicy,
    cutoff: datetime,
    chunks: list[Any],
    todo: Any,
    out: Any,
    constants: dict[str, Any] | None = None,
) -> None:
    """One worker slot: its own connection, the next chunk of the planned run until none is left.
    ``constants``: the engine's pacing constants this variant changes (``pacing.BURST_WAL_BYTES=262144``)."""
    for name, value in (constants or {}).items():
        setattr(pacing, name, value)
    batches: list[tuple[float, int, float]] = []
    paused: dict[str, float] = {}
    rows = 0
    try:
        conn = psycopg2.connect(dsn, application_name="bench-purge")
        while (index := todo.get()) is not None:
            result = run_chunk(
                conn, policy, cutoff, chunks[index], on_batch=lambda b: batches.append((time.time(), b.deleted, b.ms))
            )
            rows += result.rows_deleted
            for reason, seconds in result.paused.items():
                paused[reason] = paused.get(reason, 0.0) + seconds
        conn.close()
        out.put({"rows": rows, "batches": batches, "paused": paused})
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def engine(
    dsn: str, policy: RetentionPolicy, workers: int, constants: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """Plan once, then ``workers`` processes run the chunks of the planned run, as worker slots would."""
    conn = psycopg2.connect(dsn)
    plan = plan_run(conn, policy, pb.CUTOFF)
    conn.close()
    ctx = multiprocessing.get_context("fork")
    todo, out = ctx.Queue(), ctx.Queue()
    for index in range(len(plan.chunks)):
        todo.put(index)
    for _ in range(workers):
        todo.put(None)
    procs = [
        ctx.Process(
            target=_worker, args=(dsn, policy, plan.cutoff, list(plan.chunks), todo, out, constants), daemon=True
        )
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    reports = [out.get() for _ in procs]  # before join: a worker's result may not fit the pipe's buffer
    for p in procs:
        p.join()
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    batches = sorted(b for r in reports for b in r["batches"])
    paused: dict[str, float] = {}
    for r in reports:
        for reason, seconds in r["paused"].items():
            paused[reason] = round(paused.get(reason, 0.0) + seconds, 2)
    ms = [b[2] for b in batches]
    return sum(r["rows"] for r in reports), {
        "workers": workers,
        "chunks": len(plan.chunks),
        "batches": len(batches),
        "batch_p50_ms": round(statistics.median(ms), 1) if ms else None,
        "batch_max_ms": round(max(ms), 1) if ms else None,
        "paused_s": paused,
        "batch_log": batches,
    }


# -- one measurement ----------------------------------------------------------------------------------


def prepare(dsn: str, ledger_schema: str, *, fresh: bool = True, copies: int = 1) -> list[int]:
    """A fresh copy of the table (``fresh``; ``copies`` times the template's rows, ids shifted), pgbench's
    tables vacuumed and its history emptied, no ledger (so no budget state: every run measures its own
    baseline); returns live ids for the light foreground."""
    admin = psycopg2.connect(dsn, application_name="bench-admin")
    admin.autocommit = True
    copy = list(pb.COPY_SQL[:-1]) if fresh else []
    if copy and copies > 1:
        # Each copy's rows after the previous one's, old rows first in each: eligible rows in every third.
        copy[2:2] = [
            f"INSERT INTO bench.events SELECT id + {k} * (SELECT max(id) FROM bench.template), tenant_id,"
            " created_at, status, payload FROM bench.template"
            for k in range(1, copies)
        ]
    with admin.cursor() as cur:
        for statement in (*copy, *PGBENCH_RESET, f"DROP SCHEMA IF EXISTS {ledger_schema} CASCADE"):
            cur.execute(statement)
        cur.execute(pb.COPY_SQL[-1])  # CHECKPOINT last
        cur.execute("SELECT id FROM bench.events WHERE created_at >= %s ORDER BY id LIMIT 5000", (pb.CUTOFF,))
        live = [r[0] for r in cur.fetchall()]
    admin.close()
    return live


def measure(
    dsn: str, case: str, purge: Purge, foreground: str, args: argparse.Namespace, *, fresh: bool = True
) -> Result:
    """Copy the table (``fresh``), start the foreground, run ``purge`` (rows deleted and notes), stop the
    foreground; the foreground's latencies are those of the purge's span."""
    live = prepare(dsn, "bench_ledger", fresh=fresh)
    load = os.getloadavg()[0]  # the machine may be shared: each number says how busy it was
    admin = psycopg2.connect(dsn, application_name="bench-admin")
    admin.autocommit = True
    # The harness's own reads are the purge's bookkeeping, not a foreground: marked as a purge's session.
    Ledger("bench_ledger").mark(admin, True)
    before = pb.wal_lsn(admin)
    latencies: list[float] = []
    since = datetime.now(timezone.utc)
    transactions: list[tuple[float, float]] = []
    sampler = timeline.Sampler(dsn, setup=lambda conn: Ledger("bench_ledger").mark(conn, True))
    with tempfile.TemporaryDirectory(prefix="budget-bench-") as tmp, sampler:
        if foreground == "pgbench":
            with PgBench(dsn, args.pgbench_rate, Path(tmp), clients=args.pgbench_clients) as bench:
                time.sleep(WARMUP_S + 0.5)
                started = time.time()
                rows, notes = purge()
                ended = time.time()
            transactions = [(at, ms) for at, ms in bench.log() if started <= at <= ended]
            latencies = [ms for _, ms in transactions]
        elif foreground == "light":
            with pb.Foreground(dsn, live) as fg:
                started = time.time()
                rows, notes = purge()
                ended = time.time()
            latencies = fg.result or []
        else:
            started = time.time()
            rows, notes = purge()
            ended = time.time()
    wal = int(pb.one(admin, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (before,)))
    left = pb.one(admin, f"SELECT count(*) FROM bench.events WHERE {pb.ELIGIBLE}", {"cutoff": pb.CUTOFF})
    admin.close()
    if rows and left:
        raise AssertionError(f"{case}: {left} eligible rows left")
    batch_log = notes.pop("batch_log", None) or []
    if transactions:
        # Where the tail comes from: the slow transactions against the batches and checkpoints they met.
        notes["tail"] = timeline.causes(
            transactions,
            [(at - ms / 1000, at) for at, _, ms in batch_log],
            timeline.checkpoints(started, ended),
            sampler.samples,
            started,
            ended,
            sorted({*([round(args.slow_ms, 2)] if getattr(args, "slow_ms", None) else []), *TAIL_THRESHOLDS_MS}),
        )
    notes["load_before"] = round(load, 2)
    notes["load_after"] = round(os.getloadavg()[0], 2)
    if "workers" in notes:
        notes["budget"] = budget_summary(dsn, since)
    seconds = ended - started
    p50, p99 = percentiles(latencies)
    rate = rows / seconds if rows else 0.0
    print(f"  {seconds:.1f} s, {rows:,} rows; {foreground} p50 {p50:.2f} ms, p99 {p99:.2f} ms", flush=True)
    if tail := notes.get("tail"):
        print(
            f"  {tail['transactions']} transactions; batches {tail['time_in_batches']:.0%} of the time,"
            f" checkpoints {tail['time_in_checkpoints']}; all by overlap {tail['all_by_overlap']};"
            f" WAL {tail.get('wal_mb_s')} MB/s, disk {tail.get('disk_write_mb_s')} MB/s",
            flush=True,
        )
        for threshold, kinds in tail["slow"].items():
            print(f"    over {threshold} ms: {kinds}", flush=True)
        for key, value in tail.items():
            if key.startswith("no_batch_over_"):
                print(
                    f"    met no batch, {key.removeprefix('no_batch_over_')} ms and over [slow, all, share]: {value};"
                    f" autovacuum {tail['time_in_autovacuum']:.0%} of the time",
                    flush=True,
                )
    return Result(case, foreground, seconds, rows, rate, wal, p50, p99, len(latencies), notes)


def budget_summary(dsn: str, since: datetime) -> dict[str, Any]:
    """The budget's observations of the run: the steps it held and its moves."""
    observations = read_observations(dsn, since)
    if not observations:
        return {}
    moves: dict[str, int] = {}
    for o in observations:
        moves[o["move"]] = moves.get(o["move"], 0) + 1
    canary = [o["canary_ms"] for o in observations if o["canary_ms"] is not None]
    wal = [w for w in map(wal_rate, observations) if w is not None]
    return {
        "observations": len(observations),
        "baseline_ms": round(observations[0]["baseline_ms"], 2),
        "canary_p50_ms": round(statistics.median(canary), 2) if canary else None,
        "canary_max_ms": round(max(canary), 2) if canary else None,
        "wal_rate_p50_mb_s": round(statistics.median(wal), 2) if wal else None,
        "wal_rate_max_mb_s": round(max(wal), 2) if wal else None,
        "levels": [o["level"] for o in observations],
        "moves": moves,
    }


def wal_rate(observation: dict[str, Any]) -> float | None:
    """The server's WAL rate (MB/s) an observation read; None before there were two positions."""
    return ((observation.get("signals") or {}).get("wal_rate") or {}).get("value")


def read_observations(dsn: str, since: datetime, until: datetime | None = None) -> list[dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    try:
        return Ledger("bench_ledger").observations(conn, since, until)
    except psycopg2.Error:  # the budget off: no ledger tables of it may exist
        return []
    finally:
        conn.close()


def alone(dsn: str, foreground: str, args: argparse.Namespace, seconds: float | None = None) -> Result:
    """The foreground alone for ``seconds`` (``--alone-s``): its idle latencies (on the table as the last
    case left it, vacuumed: no copy needed)."""
    admin_execute(dsn, "VACUUM bench.events")
    idle = (0, {})
    wait = args.alone_s if seconds is None else seconds
    return measure(dsn, "alone (no purge)", lambda: (time.sleep(wait), idle)[1], foreground, args, fresh=False)


def combined(results: list[Result]) -> Result:
    """Several measurements of the same thing as one: the median of each latency, the ops summed."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    return Result(
        first.case,
        first.foreground,
        statistics.median(r.seconds for r in results),
        0,
        0.0,
        0,
        statistics.median(r.fg_p50_ms for r in results),
        statistics.median(r.fg_p99_ms for r in results),
        sum(r.fg_ops for r in results),
        {"runs": [{"fg_p50_ms": round(r.fg_p50_ms, 2), "fg_p99_ms": round(r.fg_p99_ms, 2)} for r in results]},
    )


# -- the step load ------------------------------------------------------------------------------------


def step_load(dsn: str, policy: RetentionPolicy, args: argparse.Namespace) -> dict[str, Any]:
    """The new defaults on 4 workers while pgbench's rate rises, then falls; the controller's moves."""
    low, high = args.step_rates
    rise, fall = args.step_at
    prepare(dsn, "bench_ledger", copies=args.step_copies)
    load = os.getloadavg()[0]
    since = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory(prefix="budget-step-") as tmp:
        # A low rate of 0: nobody before the rise, nobody after the fall (the budget at full speed, then
        # yielding to the foreground that arrives, then back).
        base = PgBench(dsn, low, Path(tmp), clients=args.pgbench_clients, name="base").start() if low > 0 else None
        extra = PgBench(dsn, high - low, Path(tmp), clients=args.pgbench_clients, seconds=int(fall - rise), name="step")
        time.sleep(WARMUP_S + 0.5)
        started = time.time()
        timer = threading.Timer(rise, extra.start)
        timer.start()
        try:
            rows, notes = engine(dsn, policy, max(args.workers))
        finally:
            ended = time.time()
            timer.cancel()
            if base is not None:
                base.stop()
            extra.stop()
        log = sorted(
            (base.log() if base is not None else []) + [x for x in extra.log() if x[0] >= extra.started + WARMUP_S]
        )
    observations = read_observations(dsn, since)
    batches = notes.pop("batch_log")
    period_s = policy.budget.period_ms / 1000
    span = ended - started
    per_s: dict[int, list[float]] = {}
    for at, ms in log:
        if started - 2 <= at <= ended:
            per_s.setdefault(math.floor(at - started), []).append(ms)
    # Every second of the purge, pgbench or not (None where it did not run): the rows deleted before it
    # arrived and after it left are the budget at work too.
    seconds = list(range(min([0, *per_s]), math.floor(span) + 1))
    rows_s: dict[int, int] = {}
    for at, deleted, _ms in batches:
        second = math.floor(at - started)
        rows_s[second] = rows_s.get(second, 0) + deleted
    obs = [
        {
            "t": round(o["at"].timestamp() - started, 2),
            "level": o["level"],
            "concurrency": o["concurrency"],
            "duty": o["duty"],
            "paused": o["paused"],
            "move": o["move"],
            "canary_ms": o["canary_ms"],
            "baseline_ms": o["baseline_ms"],
            "wal_mb_s": wal_rate(o),
            "wal_limit_mb_s": ((o.get("signals") or {}).get("wal_rate") or {}).get("limit"),
            "reasons": list(o["reasons"]),
        }
        for o in observations
    ]
    series = {
        "t": seconds,
        "fg_p99_ms": [
            round(max(per_s[s]) if len(per_s[s]) < 100 else percentiles(per_s[s])[1], 2) if s in per_s else None
            for s in seconds
        ],
        "fg_tps": [len(per_s.get(s, [])) for s in seconds],
        "rows_per_s": [rows_s.get(s, 0) for s in seconds],
    }
    verdict = judge(obs, rise, fall, period_s)
    print(f"step load: {rows:,} rows in {span:.1f} s; {verdict}", flush=True)
    return {
        "rows": rows,
        "seconds": round(span, 2),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "rates": [low, high],
        "rise_s": rise,
        "fall_s": fall,
        "period_s": period_s,
        "notes": notes,
        "observations": obs,
        "series": series,
        "verdict": verdict,
    }


def judge(obs: list[dict[str, Any]], rise: float, fall: float, period_s: float) -> dict[str, Any]:
    """The controller against issue 31's step-load check: down within a period of the rise, up after the
    fall, at most one step per period, and how often it turned."""
    down = next((o["t"] for o in obs if o["move"] == "down" and o["t"] >= rise), None)
    up = next((o["t"] for o in obs if o["move"] == "up" and o["t"] >= fall), None)
    levels = [o["level"] for o in obs]
    largest = max((abs(b - a) for a, b in pairwise(levels)), default=0)
    directions = [o["move"] for o in obs if o["move"] in ("up", "down")]
    turns = sum(1 for a, b in pairwise(directions) if a != b)
    gaps = [b["t"] - a["t"] for a, b in pairwise(obs)]
    return {
        "first_down_after_rise_s": round(down - rise, 2) if down is not None else None,
        "down_within_a_period": down is not None and down - rise <= period_s * 1.5,
        "first_up_after_fall_s": round(up - fall, 2) if up is not None else None,
        "largest_move_between_observations": largest,
        "direction_changes": turns,
        "observation_gap_p50_s": round(statistics.median(gaps), 2) if gaps else None,
        "observation_gap_max_s": round(max(gaps), 2) if gaps else None,
    }


def chart(step: dict[str, Any], path: Path, max_workers: int) -> None:
    """The step load over time: foreground p99 per second (and its rate), the budget's concurrency and
    duty cycle, the rows deleted per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, obs = step["series"], step["observations"]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True, constrained_layout=True)
    for ax in axes:
        ax.axvspan(step["rise_s"], step["fall_s"], color="0.92", zorder=0)
        ax.grid(True, alpha=0.3)
    ax = axes[0]
    p99 = [math.nan if ms is None else ms for ms in s["fg_p99_ms"]]  # a gap where pgbench did not run
    ax.plot(s["t"], p99, color="tab:red", label="pgbench p99 per second")
    ax.plot([o["t"] for o in obs], [o["canary_ms"] for o in obs], ".", color="tab:purple", label="canary")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    rate = ax.twinx()
    rate.step(s["t"], s["fg_tps"], where="post", color="0.5", alpha=0.6, label="pgbench tps")
    rate.set_ylabel("pgbench tps")
    lines = ax.get_legend_handles_labels()
    more = rate.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    low, high = step["rates"]
    ax.set_title(
        f"Step load: pgbench {low} → {high} → {low} tps (shaded) beside a purge on {max_workers} workers,"
        " the budget's new defaults",
        fontsize=10,
    )
    # Each observation's step holds until the next one; the last until the purge ended.
    ts = [o["t"] for o in obs] + [step["seconds"]]
    obs = [*obs, obs[-1]] if obs else obs
    axes[1].step(ts, [o["concurrency"] for o in obs], where="post", color="tab:blue")
    for o in obs[:-1]:
        if o["move"] in ("up", "down"):
            axes[1].annotate("▲" if o["move"] == "up" else "▼", (o["t"], o["concurrency"]), ha="center",
                             color="tab:green" if o["move"] == "up" else "tab:red", fontsize=8)  # fmt: skip
    axes[1].set_ylabel("batches at once")
    axes[1].set_ylim(0, max_workers + 0.5)
    axes[2].step(ts, [o["duty"] for o in obs], where="post", color="tab:orange")
    axes[2].set_ylabel("duty cycle")
    axes[2].set_yscale("log")  # the floor, min_duty: 0.5 % by default, 0.25 % at least
    axes[2].set_ylim(0.002, 1.2)
    axes[3].bar(s["t"], s["rows_per_s"], width=1.0, align="edge", color="tab:green")
    axes[3].set_ylabel("rows deleted / s")
    axes[3].set_yscale("log")  # full speed and the floor differ a hundredfold
    axes[3].set_ylim(bottom=100)
    wal = axes[3].twinx()
    seen = [o for o in obs[:-1] if o.get("wal_mb_s") is not None]
    wal.plot([o["t"] for o in seen], [o["wal_mb_s"] for o in seen], ".-", color="tab:brown", label="WAL MB/s")
    limits = [o["wal_limit_mb_s"] for o in seen if o.get("wal_limit_mb_s")]
    if limits:
        wal.axhline(limits[-1], color="tab:brown", linestyle="--", alpha=0.6, label="max_wal_rate")
    wal.set_ylabel("server WAL (MB/s)")
    wal.legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel("seconds since the purge started (an observation every period: the step lines)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart written to {path}", flush=True)


# -- the table ----------------------------------------------------------------------------------------


def against_windows(p99: float, runs: list[dict[str, Any]] | None) -> str:
    """``p99`` against the alone windows one by one, lowest to highest (``1.37-1.56``): how far the ratio
    moves with the reference alone, which on a shared machine moves by itself."""
    ratios = sorted(p99 / r["fg_p99_ms"] for r in runs or [] if r.get("fg_p99_ms"))
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else ""


def print_table(rows: int, alone_by_fg: dict[str, Result], results: list[Result]) -> None:
    print()
    print(f"{rows:,} rows, {next((r.rows for r in results if r.rows), 0):,} eligible")
    for fg, idle in alone_by_fg.items():
        print(f"  {fg} alone: p50 {idle.fg_p50_ms:.2f} ms, p99 {idle.fg_p99_ms:.2f} ms ({idle.notes.get('runs', '')})")
    print(
        f"{'case':<44} {'foreground':<10} {'s':>7} {'x(a)':>6} {'rows/s':>10} {'WAL MB':>7} {'fg p50':>7}"
        f" {'fg p99':>7} {'p99/alone':>9} {'by window':>9} {'load':>5} {'paused s by reason'}"
    )
    refs = {r.foreground: r for r in results if r.case.startswith("a.")}
    for r in results:
        ref = refs.get(r.foreground)
        idle = alone_by_fg.get(r.foreground)
        ratio = f"{r.seconds / ref.seconds:>6.2f}" if ref else f"{'':>6}"
        fg = (
            f" {r.fg_p50_ms:>7.2f} {r.fg_p99_ms:>7.2f} {r.fg_p99_ms / max(idle.fg_p99_ms, 1e-9):>9.2f}"
            f" {against_windows(r.fg_p99_ms, idle.notes.get('runs')):>9}"
            if idle
            else f" {'':>7} {'':>7} {'':>9} {'':>9}"
        )
        paused = r.notes.get("paused_s") or ""
        print(
            f"{r.case:<44} {r.foreground:<10} {r.seconds:>7.1f} {ratio} {r.rows_per_s:>10,.0f}"
            f" {r.wal_bytes / 2**20:>7.0f}{fg} {r.notes.get('load_before', 0):>5.1f} {paused}"
        )
    for r in results:
        b = r.notes.get("budget")
        if b:
            print(
                f"  {r.case} / {r.foreground}: baseline {b['baseline_ms']} ms, canary p50 {b['canary_p50_ms']} ms"
                f" max {b['canary_max_ms']} ms, WAL p50 {b.get('wal_rate_p50_mb_s')} MB/s"
                f" max {b.get('wal_rate_max_mb_s')} MB/s, moves {b['moves']}, levels {b['levels']}"
            )


def markdown(data: dict[str, Any]) -> str:
    """A results JSON as docs/performance.md's table: each case's time against (a) and each foreground's
    latency against its own alone, the pauses by reason, the load when it started."""
    alone = data["alone"]
    refs = {r["foreground"]: r for r in data["results"] if r["case"].startswith("a.")}
    lines = [
        "| case | foreground | s | x (a) | WAL MB | fg p50 ms | fg p99 ms | p99 / alone | against each alone window"
        " | paused s, by reason | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for fg, a in alone.items():
        lines.append(f"| alone (no purge) | {fg} | | | | {a['fg_p50_ms']:.2f} | {a['fg_p99_ms']:.2f} | 1 | | | |")
    for r in data["results"]:
        fg, ref = r["foreground"], refs.get(r["foreground"])
        x = f"{r['seconds'] / ref['seconds']:.2f}" if ref else ""
        lat = (
            f"{r['fg_p50_ms']:.2f} | {r['fg_p99_ms']:.2f} | {r['fg_p99_ms'] / alone[fg]['fg_p99_ms']:.2f}"
            f" | {against_windows(r['fg_p99_ms'], alone[fg].get('notes', {}).get('runs'))}"
            if fg in alone
            else " | | | "
        )
        paused = ", ".join(f"{k} {v:.0f}" for k, v in (r["notes"].get("paused_s") or {}).items())
        where = "idle database" if fg == "none" else fg
        load = r["notes"].get("load_before", "")
        wal = f"{r['wal_bytes'] / 2**20:.0f}" if r.get("wal_bytes") is not None else ""
        lines.append(f"| {r['case']} | {where} | {r['seconds']:.1f} | {x} | {wal} | {lat} | {paused} | {load} |")
    return "\n".join(lines)


def _override(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` of ``--set`` and ``--variant``, the value parsed as YAML (``0.5`` a number, ``lz4`` a string)."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise SystemExit(f"{text!r}: expected FIELD=VALUE (a policy field, e.g. wal_compression=lz4)")
    return field.strip(), yaml.safe_load(value)


def _split(changed: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Policy fields, and the engine's pacing constants (``pacing.NAME``: module constants of
    ``airflow_retention.core.running.pacing``, set in the worker processes; for A/B runs of what is not a
    policy field)."""
    fields = {k: v for k, v in changed.items() if not k.startswith("pacing.")}
    constants = {k.removeprefix("pacing."): v for k, v in changed.items() if k.startswith("pacing.")}
    for name in constants:
        if not name.isupper() or not hasattr(pacing, name):
            raise SystemExit(f"pacing.{name}: not a constant of airflow_retention.core.running.pacing")
    return fields, constants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--large", action="store_true", help="10,000,000 rows")
    parser.add_argument("--foregrounds", nargs="*", default=["pgbench", "light"], choices=["pgbench", "light"])
    parser.add_argument("--pgbench-rate", type=float, default=300, help="pgbench's fixed rate (-R), tps")
    parser.add_argument("--pgbench-clients", type=int, default=4)
    parser.add_argument("--pgbench-scale", type=int, default=10, help="pgbench -i -s")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="workers of cases b, c/d")
    parser.add_argument("--chunks", type=int, default=8, help="chunks of every engine case's planned run")
    parser.add_argument("--cases", nargs="+", default=list("abcd"), choices=list("abcd"))
    parser.add_argument("--skip-idle", action="store_true", help="leave out the cases on the idle database")
    parser.add_argument("--alone-s", type=float, default=15, help="seconds of each foreground alone")
    parser.add_argument("--skip-step", action="store_true", help="leave out the step load")
    parser.add_argument("--only-step", action="store_true", help="the step load alone")
    # The step's defaults are docs/performance.md's run: with a base rate above 0 the purge's own WAL and the
    # base's keep the WAL rate over max_wal_rate after the fall, and the budget stays at its floor (by design).
    parser.add_argument("--step-rates", type=float, nargs=2, default=[0, 300], help="pgbench's low and high rate")
    parser.add_argument(
        "--step-at", type=float, nargs=2, default=[2, 32], help="seconds into the purge the rate rises and falls"
    )
    parser.add_argument(
        "--step-copies",
        type=int,
        default=5,
        help="the step load's table: this many copies of the table's rows, so that the purge outlasts the step",
    )
    parser.add_argument("--chart", type=Path, default=BENCH.parent / "docs" / "img" / "budget-step-load.png")
    parser.add_argument("--verbose", action="store_true", help="log the budget's moves (INFO)")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="a policy field of cases c, d and the step load (YAML spelling and value, e.g. wal_compression=lz4)",
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        metavar="FIELD=VALUE[,FIELD=VALUE]",
        action="append",
        default=[],
        help="cases c and d once more with these policy fields changed, in the same run (repeatable)",
    )
    parser.add_argument(
        "--max-wal-size",
        help="run with the server's max_wal_size at this (e.g. 4GB: ALTER SYSTEM and a reload, reset at the end;"
        " needs a superuser): the first thing docs/concepts.md says to try when a purge is held at its floor",
    )
    parser.add_argument("--dsn", help="PostgreSQL server (a database 'retention_budget_bench' is recreated on it)")
    parser.add_argument("--json", type=Path, default=BENCH / "results-budget.json")
    parser.add_argument("--markdown", type=Path, help="print a results JSON as a Markdown table, and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(processName)s %(message)s")
    if args.verbose:
        logging.getLogger("airflow_retention.core.running.budget").setLevel(logging.INFO)
    rows = 10_000_000 if args.large else args.rows
    chunk_rows = max(1, int(rows * ELIGIBLE_SHARE / args.chunks))
    overrides = dict(_override(o) for o in args.overrides)
    fields, constants = _split(overrides)
    new = policy_with(chunk_rows=chunk_rows, **fields)
    # The new defaults, then each --variant of them: measured side by side in the same run.
    variants = [(overrides, new, constants)]
    for text in args.variants:
        changed = {**overrides, **dict(_override(o) for o in text.split(","))}
        fields, constants = _split(changed)
        variants.append((changed, policy_with(chunk_rows=chunk_rows, **fields), constants))
    old = policy_with(chunk_rows=chunk_rows, budget=False)
    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    if args.max_wal_size:
        if not re.fullmatch(r"[1-9][0-9]*(MB|GB)", args.max_wal_size):
            raise SystemExit(f"--max-wal-size: expected a size such as 4GB or 2048MB, got {args.max_wal_size!r}")
        admin_execute(server, f"ALTER SYSTEM SET max_wal_size = '{args.max_wal_size}'", "SELECT pg_reload_conf()")
        print(f"max_wal_size {args.max_wal_size} for this run (reset at the end)", flush=True)
    results: list[Result] = []
    alone_by_fg: dict[str, Result] = {}
    step: dict[str, Any] | None = None
    cases: list[tuple[str, Purge]] = []
    if "a" in args.cases:
        cases.append(("a. unbounded DELETE", lambda: pb.unbounded(dsn)))
    for w in args.workers:
        if "b" in args.cases:
            cases.append((f"b. budget off (before), {w} worker(s)", lambda w=w: engine(dsn, old, w)))
    for changed, policy, constants in variants:
        shown = "".join(f", {k} {v}" for k, v in changed.items())
        if "c" in args.cases and 1 in args.workers:
            cases.append((f"c. new defaults{shown}, 1 worker", lambda p=policy, k=constants: engine(dsn, p, 1, k)))
        if "d" in args.cases:
            for w in args.workers:
                if w > 1:
                    cases.append(
                        (
                            f"d. new defaults{shown}, {w} workers",
                            lambda w=w, p=policy, k=constants: engine(dsn, p, w, k),
                        )
                    )
    try:
        pb.build_template(dsn, rows)
        pgbench_init(dsn, args.pgbench_scale)
        prepare(dsn, "bench_ledger")  # a table for the foregrounds alone before the first case
        if not args.only_step:
            for fg in args.foregrounds:
                args.slow_ms = None
                if fg == args.foregrounds[0]:
                    # Discarded: the first seconds after the tables were built (autovacuum, the first
                    # reads of each table) put the first measurement's p99 at several times the next ones'.
                    print("warming up ...", flush=True)
                    alone(dsn, fg, args, min(args.alone_s, WARMUP_ALONE_S))
                before = alone(dsn, fg, args)
                # A transaction over the target (1.5x its p99 alone) is slow: what did the slow ones meet?
                args.slow_ms = 1.5 * before.fg_p99_ms
                for name, purge in cases:
                    print(f"running {name} beside {fg} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                    results.append(measure(dsn, name, purge, fg, args))
                after = alone(dsn, fg, args)
                alone_by_fg[fg] = combined([before, after])
            if not args.skip_idle:
                for name, purge in cases:
                    if name.startswith("b."):
                        continue
                    print(f"running {name} on the idle database (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                    results.append(measure(dsn, name, purge, "none", args))
        if not args.skip_step:
            print(f"running the step load (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            try:
                step = step_load(dsn, new, args)
            except Exception as exc:  # noqa: BLE001 - the cases' numbers are kept and written
                print(f"  FAILED: the step load: {type(exc).__name__}: {exc}", flush=True)
    finally:
        admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        if args.max_wal_size:
            admin_execute(server, "ALTER SYSTEM RESET max_wal_size", "SELECT pg_reload_conf()")
        print_table(rows, alone_by_fg, results)
        pb.write_json(
            args.json,
            {
                "rows": rows,
                "chunk_rows": chunk_rows,
                "pgbench": {"rate": args.pgbench_rate, "clients": args.pgbench_clients, "scale": args.pgbench_scale},
                "overrides": overrides,
                "variants": [changed for changed, _, _ in variants[1:]],
                "budget": new.budget.to_dict(),
                "ladder": [asdict(s) for s in ladder(new.budget.max_workers)],
                "alone": {fg: asdict(r) for fg, r in alone_by_fg.items()},
                "results": [asdict(r) for r in results],
                "step_load": step,
            },
        )
    if step is not None:
        chart(step, args.chart, new.budget.max_workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
