"""Purge benchmark: one unbounded DELETE against the common LIMIT loop, the planner + chunk engine, and the
whole DAG through ``dag.test()`` and under the real scheduler, measured side by side in one run.

    python benchmarks/purge_benchmark.py [--rows N | --large] [--workers 1 2] [--methods a b c d e]
                                         [--memory-sizes 2000000 10000000] [--dsn DSN] [--json out.json]
                                         [--compare OTHER_SIZE.json [--project-rows 100000000]]

Builds a table of N rows (realistic width, primary key, an index on the timestamp and on (tenant, id),
about 56 % eligible) once, copies it before each method so every method starts from the same table, and
for each method measures: wall seconds, rows/s, the longest writing transaction (sampled every 20 ms from
``pg_stat_activity``: transactions with an xid, whoever runs them), WAL bytes (``pg_current_wal_lsn()``
before and after), and the p50/p99 latency of a concurrent foreground load of single-row reads and writes
on live rows (and of the same load on the idle database first). Prints ratios to method (a), the
unbounded DELETE, and writes JSON. ``--memory-sizes`` also measures the planner's peak Python memory
(tracemalloc) on tables of those sizes. ``--compare`` reads the JSON of a run at another size and
prints each method's time as a line in the eligible rows: slope, time at 0 rows, projection.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_retention.core.ledger.ledger import Ledger  # noqa: E402
from airflow_retention.core.planning.planner import compute_plan, plan_run  # noqa: E402
from airflow_retention.core.policy.loading import policy_to_dict  # noqa: E402
from airflow_retention.core.policy.model import RetentionPolicy  # noqa: E402
from airflow_retention.core.running.engine import run_chunk  # noqa: E402
from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

# A database of its own, recreated; RETENTION_BENCH_DB lets two benchmarks run side by side.
DB = os.environ.get("RETENTION_BENCH_DB", "retention_bench")
CUTOFF = datetime(2026, 1, 1, tzinfo=timezone.utc)
RUN_DATE = CUTOFF + timedelta(days=1)  # the DAG run whose cutoff is CUTOFF (retention 1 day)
LIMIT_LOOP_BATCH = 5000
FOREGROUND_RATE = 500  # single-row reads and writes per second
TEMPLATE_SQL = """
DROP TABLE IF EXISTS bench.template;
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE bench.template AS
SELECT g::bigint AS id,
       (g %% 50)::integer AS tenant_id,
       %(cutoff)s::timestamptz - interval '60 days' + (g::float / %(rows)s) * interval '100 days' AS created_at,
       CASE WHEN g %% 17 = 0 THEN 'open' ELSE 'closed' END AS status,
       {payload} AS payload
FROM generate_series(1, %(rows)s) g;
"""
# The payload column's contents (``--payload``): how well its pages compress sets what wal_compression saves.
PAYLOADS = {
    # 32 hex digits six times over: compresses about 3x (every earlier run of these benchmarks).
    "repeated": "repeat(md5(g::text), 6)",
    # An event as JSON: repeated keys, random-looking ids and values.
    "json": (
        "json_build_object('user_id', (g::bigint * 7919) %% 100000, 'event', (ARRAY['page_view', 'click',"
        " 'purchase', 'signup'])[g %% 4 + 1], 'session', md5(g::text), 'amount', ((g::bigint * 31) %% 10000)"
        " / 100.0, 'ua', 'Mozilla/5.0 (X11; Linux x86_64)')::text"
    ),
    # 96 bytes that do not repeat, base64: compresses least.
    "random": "encode(decode(md5(g::text) || md5((g + 1)::text) || md5((g + 2)::text), 'hex'), 'base64')",
}
# --clustered: the same rows stored tenant by tenant (as after CLUSTER on (tenant_id, id)), the case
# where per-tenant key chunks touch each block once too.
CLUSTERED = ", stored tenant by tenant"
CLUSTER_SQL = """
CREATE TABLE bench.sorted AS SELECT * FROM bench.template ORDER BY tenant_id, id;
DROP TABLE bench.template;
ALTER TABLE bench.sorted RENAME TO template;
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
# With OVERRIDES: tenants 1 to 5 keep two days, so their cutoff is a day earlier.
ELIGIBLE_OVERRIDES = (
    "status <> 'open' AND created_at < CASE WHEN tenant_id BETWEEN 1 AND 5"
    " THEN %(cutoff)s - interval '1 day' ELSE %(cutoff)s END"
)
BENCH_DAG = """
import json, os
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.dag_factory import build_dag

for data in json.loads(os.environ["BENCH_POLICIES"]):
    dag = build_dag(RetentionPolicy.from_dict(data))  # default settings: verify decides at its first look
    globals()[dag.dag_id] = dag
"""


# Five tenants that keep their rows twice as long: the one-pass run with per-tenant retention.
OVERRIDES = {str(t): "2 days" for t in range(1, 6)}


def bench_policy(
    *,
    chunk_by: str = "block",
    tenants: bool = False,
    max_active_chunks: int = 1,
    one_pass: bool = False,
    overrides: bool = False,
    wal_compression: str = "server",
) -> RetentionPolicy:
    """The policy every engine method runs: the project's defaults (batch size, adaptive batches,
    chunk_rows), a condition; block ranges (the default here, for an append-mostly events table), key
    ranges, per-tenant key ranges, or block ranges of every tenant in one pass (``one_pass``, with
    per-tenant retention for five tenants with ``overrides``)."""
    return RetentionPolicy(
        chunk_by="block" if one_pass else ("key" if tenants else chunk_by),
        tenant_retention=OVERRIDES if overrides else {},
        name="bench",
        conn_id="retention_target",
        table="bench.events",
        key_column="id",
        timestamp_column="created_at",
        tenant_column="tenant_id" if tenants or one_pass else None,
        retention="1 day",
        condition="status <> 'open'",
        ledger_schema="bench_ledger",
        schedule=None,
        max_active_chunks=max_active_chunks,
        retries=0,
        wal_compression=wal_compression,
    )


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
    fg_mean_ms: float = 0.0


def _foreground(dsn: str, live_ids: list[int], stop: Any, out: Any) -> None:
    conn = psycopg2.connect(dsn, application_name="bench-fg")
    conn.autocommit = True
    cur = conn.cursor()
    latencies: list[float] = []
    i = 0
    next_at = time.perf_counter()
    while not stop.is_set():
        # An open loop at a fixed rate, as application traffic arrives: a closed loop as fast as one
        # session goes would take a whole core of this 2-core machine from the method under test.
        next_at += 1 / FOREGROUND_RATE
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        row_id = live_ids[i % len(live_ids)]
        started = time.perf_counter()
        if i % 2:
            cur.execute("UPDATE bench.events SET payload = payload WHERE id = %s", (row_id,))
        else:
            cur.execute("SELECT payload FROM bench.events WHERE id = %s", (row_id,))
            cur.fetchall()
        latencies.append((time.perf_counter() - started) * 1000)
        if i == 0:
            out.send("started")
        i += 1
    conn.close()
    out.send(latencies)


def _monitor(dsn: str, interval: float, stop: Any, out: Any) -> None:
    conn = psycopg2.connect(dsn, application_name="bench-monitor")
    conn.autocommit = True
    cur = conn.cursor()
    longest = 0.0
    out.send("started")
    while not stop.is_set():
        cur.execute(TxnMonitor.SQL)
        longest = max(longest, float(cur.fetchone()[0]))
        time.sleep(interval)
    conn.close()
    out.send(longest)


class _Sidecar:
    """A process of its own beside the method under test, so that its work never competes for this
    process's GIL (an engine waiting for the GIL between two statements would look slower than it is)."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        self.receive, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=target, args=(*args, self.stop, send), daemon=True)
        self.result: Any = None

    def __enter__(self) -> _Sidecar:
        self.process.start()
        assert self.receive.recv() == "started"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.result = self.receive.recv()
        self.process.join()


class Foreground(_Sidecar):
    """Single-row reads and writes on live (never eligible) rows, ``FOREGROUND_RATE`` a second."""

    def __init__(self, dsn: str, live_ids: list[int]) -> None:
        super().__init__(_foreground, dsn, live_ids)

    def percentiles(self) -> tuple[float, float]:
        latencies = self.result or []
        if len(latencies) < 2:
            return 0.0, 0.0
        q = statistics.quantiles(latencies, n=100)
        return q[49], q[98]

    def mean(self) -> float:
        return statistics.fmean(self.result) if self.result else 0.0


class TxnMonitor(_Sidecar):
    """The longest writing transaction in the bench database, whoever runs it (a worker of ours, an
    Airflow task process, a psql session), sampled from ``pg_stat_activity``."""

    SQL = (
        "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)) * 1000, 0)"
        " FROM pg_stat_activity WHERE datname = current_database() AND backend_xid IS NOT NULL"
        " AND pid <> pg_backend_pid() AND application_name <> 'bench-fg'"
    )

    def __init__(self, dsn: str, interval: float = 0.02) -> None:
        super().__init__(_monitor, dsn, interval)

    @property
    def longest(self) -> float:
        return float(self.result or 0.0)


def one(conn: Any, sql: str, params: Any = None) -> Any:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()[0]


def wal_lsn(conn: Any) -> str:
    return one(conn, "SELECT pg_current_wal_lsn()::text")


Purge = Callable[[], tuple[int, dict[str, Any]]]


def measure(dsn: str, name: str, purge: Purge, *, purges: bool = True, eligible: str = ELIGIBLE) -> Result:
    """Copy the template, start the foreground load and the transaction monitor, run ``purge`` (returns
    rows deleted and notes; a ``seconds`` note overrides the wall clock, e.g. the DAG run's own duration)."""
    admin = psycopg2.connect(dsn, application_name="bench-admin")
    admin.autocommit = True
    with admin.cursor() as cur:
        for statement in COPY_SQL:
            cur.execute(statement)
        cur.execute("SELECT id FROM bench.events WHERE created_at >= %s ORDER BY id LIMIT 5000", (CUTOFF,))
        live = [r[0] for r in cur.fetchall()]
    admin_execute(dsn, "DROP SCHEMA IF EXISTS bench_ledger CASCADE")
    before = wal_lsn(admin)
    with Foreground(dsn, live) as fg, TxnMonitor(dsn) as monitor:
        started = time.perf_counter()
        rows, notes = purge()
        seconds = notes.pop("seconds", None) or time.perf_counter() - started
    wal = int(one(admin, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (before,)))
    left = one(admin, f"SELECT count(*) FROM bench.events WHERE {eligible}", {"cutoff": CUTOFF})
    admin.close()
    if purges and left:
        raise AssertionError(f"{name}: {left} eligible rows left")
    p50, p99 = fg.percentiles()
    fg_ops = len(fg.result or [])
    return Result(name, seconds, rows, rows / seconds, monitor.longest, wal, p50, p99, fg_ops, notes, fg.mean())


def unbounded(dsn: str, cutoff: datetime = CUTOFF) -> tuple[int, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute(f"DELETE FROM bench.events WHERE {ELIGIBLE}", {"cutoff": cutoff})
        rows = cur.rowcount
    conn.commit()
    conn.close()
    return rows, {}


def limit_loop(dsn: str) -> tuple[int, dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    rows, loops = 0, 0
    while True:
        with conn.cursor() as cur:
            cur.execute(
                f"DELETE FROM bench.events WHERE id IN (SELECT id FROM bench.events WHERE {ELIGIBLE} LIMIT %(n)s)",
                {"cutoff": CUTOFF, "n": LIMIT_LOOP_BATCH},
            )
            n = cur.rowcount
        conn.commit()
        rows += n
        loops += 1
        if n == 0:
            break
    conn.close()
    return rows, {"transactions": loops}


def engine(
    dsn: str, workers: int, chunk_by: str = "block", tenants: bool = False, **policy_kwargs: Any
) -> tuple[int, dict[str, Any]]:
    """The planner, then the chunks shared by ``workers`` threads, each with its own connection."""
    policy = bench_policy(chunk_by=chunk_by, tenants=tenants, **policy_kwargs)
    conn = psycopg2.connect(dsn)
    started = time.perf_counter()
    plan = plan_run(conn, policy, CUTOFF)
    planning = time.perf_counter() - started
    conn.close()
    queue = list(plan.chunks)
    lock = threading.Lock()
    totals: dict[str, Any] = {"rows": 0, "batches": 0, "longest_batch_ms": 0.0, "sizes": []}

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
                totals["longest_batch_ms"] = max(totals["longest_batch_ms"], *(b.ms for b in result.batch_log))
                totals["sizes"].append(result.last_batch_size)
        c.close()

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    extra: dict[str, Any] = {}
    if policy.tenant_column is not None and policy.chunk_by == "block":
        c = psycopg2.connect(dsn)
        counted = sum(t["rows_deleted"] for t in Ledger(policy.ledger_schema).tenant_counts(c, plan.run_key))
        c.close()
        extra = {"tenant_counts_total": counted, "tenant_counts_match_rows_gone": counted == totals["rows"]}
    return int(totals["rows"]), {
        **extra,
        "chunks": len(plan.chunks),
        "batches": totals["batches"],
        "planning_s": round(planning, 2),
        "longest_batch_ms": round(totals["longest_batch_ms"], 1),
        "settled_batch_sizes": sorted(set(totals["sizes"])),
    }


def ledger_totals(dsn: str, cutoff: datetime = CUTOFF) -> dict[str, Any]:
    """What the ledger says about the bench run at ``cutoff``: rows, chunks, the largest batch size."""
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.rows_deleted, r.chunks_expected, r.state,"
            " max(c.last_batch_size), count(*) FILTER (WHERE c.state = 'complete')"
            " FROM bench_ledger.runs r LEFT JOIN bench_ledger.chunks c USING (run_key)"
            " WHERE r.cutoff = %s GROUP BY r.run_key, r.rows_deleted, r.chunks_expected, r.state",
            (cutoff,),
        )
        rows, chunks, state, max_size, complete = cur.fetchone()
    conn.close()
    if state != "complete" or complete != chunks:
        raise AssertionError(f"bench run not complete in the ledger: state {state}, {complete}/{chunks} chunks")
    return {"rows": int(rows or 0), "chunks": chunks, "max_batch_size": max_size}


def dag_test(dsn: str) -> tuple[int, dict[str, Any]]:
    """The whole DAG (plan → mapped chunks → verify) through ``dag.test()`` in a child process with a
    throwaway Airflow home; the child times ``dag.test()`` alone (not Airflow's import and migration)."""
    home = Path(tempfile.mkdtemp(prefix="retention-bench-"))
    dags = home / "dags"
    dags.mkdir()
    (dags / "bench_dag.py").write_text(BENCH_DAG)
    env = {**os.environ, "BENCH_POLICIES": json.dumps([policy_to_dict(bench_policy())])}
    out = subprocess.run(
        [sys.executable, __file__, "--dag-test-child", str(home), dsn],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    totals = ledger_totals(dsn)
    return totals["rows"], {"seconds": child["seconds"], "state": child["state"], **totals}


def dag_test_child(home: Path, dsn: str) -> None:
    from airflow_retention.demo.airflow_home import prepare_airflow_home

    prepare_airflow_home(home, home / "dags", dsn)
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(str(home / "dags")).dags["retention_bench"]
    started = time.perf_counter()
    run = dag.test(logical_date=RUN_DATE)
    print(json.dumps({"seconds": time.perf_counter() - started, "state": str(run.state)}))


class Scheduler:
    """Method (e): a real Airflow (scheduler, dag-processor, api-server, triggerer, LocalExecutor)
    started once, before the timed part; each measurement triggers one DAG run through the REST API.
    One DAG per policy given (``retention_<name>``)."""

    def __init__(
        self, server: str, dsn: str, policies: list[RetentionPolicy], extra_env: dict[str, str] | None = None
    ) -> None:
        from tests.deployment.harness import Deployment

        self.dags = Path(tempfile.mkdtemp(prefix="retention-bench-dags-"))
        (self.dags / "bench_dag.py").write_text(BENCH_DAG)
        self.dag_ids = [f"retention_{p.name}" for p in policies]
        slots = max(p.max_active_chunks for p in policies)
        self.deployment = Deployment(
            server_dsn=server,
            target_dsn=dsn,
            dags_folder=self.dags,
            env={
                "BENCH_POLICIES": json.dumps([policy_to_dict(p) for p in policies]),
                "AIRFLOW__CORE__PARALLELISM": str(max(8, slots + 2)),
                "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
                **(extra_env or {}),
            },
        )
        self.runs = 0

    def __enter__(self) -> Scheduler:
        self.deployment.__enter__()
        for dag_id in self.dag_ids:
            self.deployment.wait_for_dag(dag_id, timeout=180)
            self.deployment.unpause(dag_id)
        # One untimed run first, on the table as the last method left it (purged by (a)): the first
        # task processes after Airflow starts pay a cold start of seconds (3.9 and 6.6 s measured for the
        # plan task) that a deployment running every day does not.
        started = time.perf_counter()
        self.purge(self.dag_ids[0])
        print(f"warm-up run (untimed) took {time.perf_counter() - started:.1f} s", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.deployment.__exit__(None, None, None)

    def purge(self, dag_id: str, run_date: datetime = RUN_DATE) -> tuple[int, dict[str, Any]]:
        """Trigger one run of ``dag_id`` for ``run_date`` (cutoff a day before), wait for it, measure it,
        then delete the DAG run (not its ledger rows), so that the same date can run again."""
        d = self.deployment
        self.runs += 1
        run_id = f"bench_{self.runs}"
        cutoff = run_date - (RUN_DATE - CUTOFF)
        d.api("POST", f"/dags/{dag_id}/dagRuns", json={"dag_run_id": run_id, "logical_date": run_date.isoformat()})

        def finished() -> dict[str, Any] | None:
            run = d.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
            return run if run["state"] in ("success", "failed") else None

        run = d.wait_until(finished, 1800, f"bench run {run_id}", interval=0.5)
        if run["state"] != "success":
            raise AssertionError(f"bench DAG run {run_id} failed; logs in {d.home}")
        tis = d.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000})
        fixed = fixed_cost(run, tis["task_instances"], deleting_seconds(d.target_dsn, cutoff))
        plan = next(t for t in tis["task_instances"] if t["task_id"].endswith(".plan"))
        xcom = d.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{plan['task_id']}/xcomEntries/run")
        value = xcom["value"]
        planner = float((json.loads(value) if isinstance(value, str) else value)["planning_seconds"])
        # From the trigger (the run's creation), as a DELETE is timed from its sending.
        seconds = fixed["whole"]
        totals = ledger_totals(d.target_dsn, cutoff)
        # One run per logical date and DAG: the next measurement re-runs the same date.
        d.api("DELETE", f"/dags/{dag_id}/dagRuns/{run_id}")
        return totals["rows"], {
            "seconds": seconds,
            "plan_task_s": round(float(plan["duration"] or 0), 2),
            "planner_s": round(planner, 3),
            "planner_share": round(planner / seconds, 4),
            "task_instances": len(tis["task_instances"]),
            "fixed_cost": fixed,
            **totals,
        }


def _instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def deleting_seconds(dsn: str, cutoff: datetime = CUTOFF) -> float:
    """Wall seconds during which at least one chunk of the bench run at ``cutoff`` was at work, by the
    ledger (each chunk from its first start to its completion): the union of those intervals."""
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT c.first_started_at, c.completed_at FROM bench_ledger.chunks c JOIN bench_ledger.runs r"
            " USING (run_key) WHERE r.cutoff = %s AND c.first_started_at IS NOT NULL"
            " AND c.completed_at IS NOT NULL ORDER BY c.first_started_at",
            (cutoff,),
        )
        spans = cur.fetchall()
    conn.close()
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += (stop - start).total_seconds()
            end = stop
        elif stop > end:
            busy += (stop - end).total_seconds()
            end = stop
    return busy


# The fixed cost of a run, step by step, in the order the steps happen.
FIXED_COST_STEPS = (
    ("trigger_to_plan_start", "trigger → plan start"),
    ("plan", "plan task"),
    ("plan_end_to_first_chunk", "plan end → first chunk start"),
    ("chunks_span", "first chunk start → last chunk end"),
    ("last_chunk_to_verify_start", "last chunk end → verify start"),
    ("verify", "verify task"),
    ("verify_end_to_run_end", "verify end → run end"),
)


def fixed_cost(run: dict[str, Any], tis: list[dict[str, Any]], deleting: float) -> dict[str, float]:
    """Where a scheduled run's time goes, from its task instances' start and end dates: the steps of
    FIXED_COST_STEPS, the whole (trigger to run end), the chunks' deleting time (``deleting``, from the
    ledger) and the fixed cost, the whole minus the deleting time."""

    def at(ti: dict[str, Any], field: str) -> datetime:
        return _instant(ti[field])

    def ended(suffix: str) -> list[dict[str, Any]]:
        return [t for t in tis if t["task_id"].endswith(suffix) and t["start_date"] and t["end_date"]]

    (plan,) = ended(".plan")
    (verify,) = ended(".verify")
    chunks = ended(".purge_chunk")
    triggered, finished = _instant(run["queued_at"] or run["start_date"]), _instant(run["end_date"])
    first = min((at(t, "start_date") for t in chunks), default=at(plan, "end_date"))
    last = max((at(t, "end_date") for t in chunks), default=at(plan, "end_date"))
    steps = {
        "trigger_to_plan_start": at(plan, "start_date") - triggered,
        "plan": at(plan, "end_date") - at(plan, "start_date"),
        "plan_end_to_first_chunk": first - at(plan, "end_date"),
        "chunks_span": last - first,
        "last_chunk_to_verify_start": at(verify, "start_date") - last,
        "verify": at(verify, "end_date") - at(verify, "start_date"),
        "verify_end_to_run_end": finished - at(verify, "end_date"),
    }
    out = {name: round(delta.total_seconds(), 2) for name, delta in steps.items()}
    whole = (finished - triggered).total_seconds()
    out.update(
        whole=round(whole, 2),
        deleting=round(deleting, 2),
        fixed=round(whole - deleting, 2),
        chunk_tasks=len(chunks),
    )
    return out


def print_fixed_costs(results: list[Result]) -> None:
    """The fixed cost of each scheduled run (method e), step by step, side by side."""
    runs = [r for r in results if "fixed_cost" in r.notes]
    if not runs:
        return
    print()
    print("fixed cost of a scheduled run (s): the whole DAG run (trigger to end) minus its chunks' deleting time")
    names = [r.method.split("at once, ", 1)[-1] for r in runs]
    print(f"{'step':<36}" + "".join(f" {n:>22}" for n in names))
    rows = [*FIXED_COST_STEPS, ("whole", "whole run (trigger → end)"), ("deleting", "chunks deleting (ledger)")]
    for key, label in [*rows, ("fixed", "fixed cost (whole − deleting)"), ("chunk_tasks", "chunk tasks")]:
        values = [r.notes["fixed_cost"][key] for r in runs]
        print(f"{label:<36}" + "".join(f" {v:>22,.2f}" if key != "chunk_tasks" else f" {v:>22}" for v in values))


def slopes(rows: int, results: list[Result], other: dict[str, Any], project_rows: int) -> list[dict[str, Any]]:
    """Each method's time as a straight line in the eligible rows, through this run and ``other`` (the
    JSON of a run at another size, ``--compare``): the per-row slope, the intercept (what a run costs
    whatever its size: for the DAG, its fixed cost) and the time projected to ``project_rows`` table
    rows of the same shape, each beside method (a)'s."""
    before = {r["method"]: r for r in other["results"]}
    lines = []
    for r in results:
        o = before.get(r.method)
        if o is None or o["rows"] == r.rows:
            continue
        (small, large) = sorted([(o["rows"], o["seconds"], other["rows"]), (r.rows, r.seconds, rows)])
        slope = (large[1] - small[1]) / (large[0] - small[0])  # seconds per eligible row
        eligible = large[0] * project_rows / large[2]
        lines.append(
            {
                "method": r.method,
                "rows": (small[2], large[2]),
                "seconds": (round(small[1], 2), round(large[1], 2)),
                "slope_s_per_m_rows": round(slope * 1e6, 3),
                "intercept_s": round(large[1] - slope * large[0], 2),
                "projected_rows": project_rows,
                "projected_eligible": round(eligible),
                "projected_s": round(large[1] + slope * (eligible - large[0]), 1),
            }
        )
    if lines and lines[0]["method"].startswith("a."):
        ref = lines[0]
        for line in lines:
            line["slope_x_a"] = round(line["slope_s_per_m_rows"] / ref["slope_s_per_m_rows"], 2)
            line["projected_x_a"] = round(line["projected_s"] / ref["projected_s"], 2)
    return lines


def print_slopes(lines: list[dict[str, Any]], source: Path | str) -> None:
    """Seconds at both sizes, the slope per million eligible rows and the projection, times of (a)."""
    if not lines:
        return
    small, large = lines[0]["rows"]
    print()
    print(
        f"time as a line in the eligible rows, through {small:,} and {large:,} rows ({source});"
        f" projected to {lines[0]['projected_rows']:,} rows ({lines[0]['projected_eligible']:,} eligible)"
    )
    print(
        f"{'method':<62} {'s small':>8} {'s large':>8} {'x(a)':>6} {'s/M rows':>9} {'x(a)':>6}"
        f" {'at 0 s':>8} {'projected s':>12} {'x(a)':>6}"
    )
    ref = lines[0] if lines[0]["method"].startswith("a.") else None
    for line in lines:
        time_x = line["seconds"][1] / ref["seconds"][1] if ref else float("nan")
        slope_x, projected_x = line.get("slope_x_a", float("nan")), line.get("projected_x_a", float("nan"))
        print(
            f"{line['method']:<62} {line['seconds'][0]:>8.1f} {line['seconds'][1]:>8.1f} {time_x:>6.2f}"
            f" {line['slope_s_per_m_rows']:>9.3f} {slope_x:>6.2f}"
            f" {line['intercept_s']:>8.1f} {line['projected_s']:>12,.1f} {projected_x:>6.2f}"
        )


def planner_memory(dsn: str, sizes: list[int]) -> list[dict[str, Any]]:
    """Peak Python memory of the planner (tracemalloc) on tables of each size: it must not grow with
    the table, since the server finds the chunk boundaries."""
    out = []
    for rows in sizes:
        build_template(dsn, rows)
        admin = psycopg2.connect(dsn)
        admin.autocommit = True
        with admin.cursor() as cur:
            for statement in COPY_SQL:
                cur.execute(statement)
        admin.close()
        for mode in ("block", "key", "tenant"):
            conn = psycopg2.connect(dsn)
            tracemalloc.start()
            started = time.perf_counter()
            policy = bench_policy(chunk_by="key", tenants=True) if mode == "tenant" else bench_policy(chunk_by=mode)
            preview = compute_plan(conn, policy, CUTOFF)
            seconds = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            conn.close()
            out.append(
                {
                    "rows": rows,
                    "chunks_by": mode,
                    "chunks": len(preview.chunks),
                    "peak_kib": round(peak / 1024, 1),
                    "seconds": round(seconds, 2),
                }
            )
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A benchmark's numbers as JSON (datetimes as text), and where they went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"\nresults written to {path}")


def build_template(dsn: str, rows: int, clustered: bool = False, payload: str = "repeated") -> None:
    what = f"{CLUSTERED if clustered else ''}{'' if payload == 'repeated' else f', {payload} payload'}"
    print(f"building bench.template with {rows:,} rows{what} ...", flush=True)
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(TEMPLATE_SQL.replace("{payload}", PAYLOADS[payload]), {"rows": rows, "cutoff": CUTOFF})
        if clustered:
            cur.execute(CLUSTER_SQL)
    admin.close()


def median_of(repeat: int, dsn: str, name: str, purge: Purge) -> Result | None:
    """Measure ``repeat`` times; keep the run with the median wall time (its other numbers with it).
    A method that fails is reported and left out, so one failure does not lose the others' numbers."""
    runs = []
    for i in range(repeat):
        print(f"running {name}" + (f" ({i + 1}/{repeat})" if repeat > 1 else "") + " ...", flush=True)
        try:
            runs.append(measure(dsn, name, purge, eligible=ELIGIBLE_OVERRIDES if "keep 2 days" in name else ELIGIBLE))
        except Exception as exc:  # noqa: BLE001 - reported, and the table says the method is missing
            print(f"  FAILED: {name}: {exc}", flush=True)
            return None
    runs.sort(key=lambda r: r.seconds)
    chosen = runs[len(runs) // 2]
    if repeat > 1:
        chosen.notes["all_seconds"] = [round(r.seconds, 2) for r in runs]
    return chosen


def print_table(rows: int, idle: Result, results: list[Result], clustered: bool = False) -> None:
    ref = results[0]
    print()
    print(
        f"{rows:,} rows{CLUSTERED if clustered else ''}, {ref.rows:,} eligible;"
        f" foreground idle p50 {idle.fg_p50_ms:.2f} ms, p99 {idle.fg_p99_ms:.2f} ms"
    )
    header = f"{'method':<46} {'s':>7} {'rows/s':>10} {'x(a)':>6} {'longest txn ms':>15} {'WAL MB':>8} {'x(a)':>6}"
    header += f" {'fg p50':>7} {'fg p99':>7} {'p99/idle':>8}"
    print(header)
    for r in results:
        print(
            f"{r.method:<46} {r.seconds:>7.1f} {r.rows_per_s:>10,.0f} {r.rows_per_s / ref.rows_per_s:>6.2f}"
            f" {r.longest_txn_ms:>15,.0f} {r.wal_bytes / 2**20:>8.0f} {r.wal_bytes / max(ref.wal_bytes, 1):>6.2f}"
            f" {r.fg_p50_ms:>7.2f} {r.fg_p99_ms:>7.2f} {r.fg_p99_ms / max(idle.fg_p99_ms, 1e-9):>8.1f}"
        )
    for r in results:
        if r.notes:
            print(f"  {r.method}: {r.notes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--large", action="store_true", help="10,000,000 rows")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="engine workers for (c)")
    parser.add_argument("--methods", nargs="+", default=list("abcde"), choices=list("abcde"))
    parser.add_argument(
        "--e-chunk-rows", type=int, default=1_000_000, help="(e) also runs with chunks this big (fewer tasks)"
    )
    parser.add_argument("--clustered", action="store_true", help="rows stored tenant by tenant, not interleaved")
    parser.add_argument("--skip-tenants", action="store_true", help="leave out (c) with per-tenant chunks")
    parser.add_argument("--repeat", type=int, default=1, help="measure each method this many times; report the median")
    parser.add_argument("--memory-sizes", type=int, nargs="*", default=None, help="planner memory at these sizes")
    parser.add_argument("--dsn", help="PostgreSQL server (a database 'retention_bench' is recreated on it)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results.json")
    parser.add_argument(
        "--compare",
        type=Path,
        help="the JSON of a run at another size: print each method's per-row slope and the projection",
    )
    parser.add_argument("--project-rows", type=int, default=100_000_000, help="project --compare's line to this")
    parser.add_argument("--dag-test-child", nargs=2, metavar=("HOME", "DSN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dag_test_child:
        dag_test_child(Path(args.dag_test_child[0]), args.dag_test_child[1])
        return 0
    rows = 10_000_000 if args.large else args.rows
    memory_sizes = args.memory_sizes if args.memory_sizes is not None else ([2_000_000, rows] if args.large else [])

    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    try:
        memory = planner_memory(dsn, sorted(set(memory_sizes))) if memory_sizes else []
        build_template(dsn, rows, args.clustered)
        idle = measure(dsn, "idle (no purge)", lambda: (time.sleep(3), (0, {}))[1], purges=False)
        methods: list[tuple[str, Purge]] = [("a. unbounded DELETE", lambda: unbounded(dsn))]
        if "b" in args.methods:
            methods.append((f"b. DELETE ... IN (SELECT ... LIMIT {LIMIT_LOOP_BATCH}) loop", lambda: limit_loop(dsn)))
        if "c" in args.methods:
            for w in args.workers:
                methods.append((f"c. planner + engine, blocks, {w} worker(s)", lambda w=w: engine(dsn, w)))
            methods.append(("c. planner + engine, key ranges, 1 worker", lambda: engine(dsn, 1, "key")))
            if not args.skip_tenants:
                methods.append(("c. planner + engine, per-tenant keys, 1 worker", lambda: engine(dsn, 1, tenants=True)))
            for w in args.workers:
                methods.append(
                    (f"c. one pass over all tenants, {w} worker(s)", lambda w=w: engine(dsn, w, one_pass=True))
                )
            methods.append(
                ("c. one pass, 5 tenants keep 2 days, 1 worker", lambda: engine(dsn, 1, one_pass=True, overrides=True))
            )
        if "d" in args.methods:
            methods.append(("d. whole DAG, dag.test()", lambda: dag_test(dsn)))
        results: list[Result | None] = []
        for name, purge in methods:
            results.append(median_of(args.repeat, dsn, name, purge))
        if "e" in args.methods:
            workers = max(args.workers)
            default = bench_policy(max_active_chunks=workers)
            big = RetentionPolicy.from_dict(
                {**policy_to_dict(default), "name": "bench_big", "chunk_rows": args.e_chunk_rows}
            )
            print(f"starting Airflow (scheduler, LocalExecutor, {workers} chunk task(s) at once) ...", flush=True)
            with Scheduler(server, dsn, [default, big]) as scheduler:
                for policy in (default, big):
                    sizing = f"chunk_rows {policy.chunk_rows:,}" if policy.chunk_rows else "chunks sized by time"
                    name = f"e. scheduler + LocalExecutor, {workers} at once, {sizing}"
                    purge = lambda dag_id=f"retention_{policy.name}": scheduler.purge(dag_id)  # noqa: E731
                    results.append(median_of(args.repeat, dsn, name, purge))
    finally:
        admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    failed = [r for r in results if r is None]
    results = [r for r in results if r is not None]
    print_table(rows, idle, results, args.clustered)
    print_fixed_costs(results)
    lines = slopes(rows, results, json.loads(args.compare.read_text()), args.project_rows) if args.compare else []
    print_slopes(lines, f"the other run: {args.compare}")
    for m in memory:
        print(
            f"planner memory: {m['rows']:>12,} rows, {m['chunks_by']:>6} chunks:"
            f" {m['chunks']:>4} chunks, peak {m['peak_kib']:>8,.1f} KiB, {m['seconds']:.2f} s"
        )
    write_json(
        args.json,
        {
            "rows": rows,
            "idle": asdict(idle),
            "results": [asdict(r) for r in results],
            "planner_memory": memory,
            "slopes": lines,
        },
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
