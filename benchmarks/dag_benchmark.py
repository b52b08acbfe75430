"""Whole-DAG benchmark: the DAG under the real scheduler against one unbounded DELETE, at two table sizes in
one run, so that the per-row slopes and the fixed cost come from the same machine state.

    python benchmarks/dag_benchmark.py [--sizes 2000000 10000000] [--repeat 3] [--dsn DSN] [--json out.json]

The table, the copy before every measurement, the foreground load and the transaction monitor are those of
``purge_benchmark.py`` (56 % of the rows eligible, 50 tenants). Both sizes are built once, up front. One
Airflow (scheduler, dag-processor, api-server, triggerer as processes, LocalExecutor, metadata in
PostgreSQL) runs the retention DAG of the benchmark policy with the project's defaults (chunks sized by
time, ``max_active_chunks`` 2). Each repetition measures, for each size in turn, (a) the unbounded DELETE
and then (e) one DAG run on a fresh copy, so that a change of the machine's load hits both alike; the
median of the repetitions is reported. After each (a) and each (e) the **next night** runs at once on the
table it left, as in a backfill, before any VACUUM: the next logical date, one more day of rows (1 % of the
table). For (a) one more unbounded DELETE; for (e) one more DAG run, whose plan task also measures the first
run's cleanup lag (a run over 200,000 rows leaves it to the next run's planning), paying the walk over the
first run's deleted rows.

Prints, per size, the seconds and ratio to (a), the longest writing transaction, WAL and the foreground's
p99 against idle; the fixed cost of a run step by step (the whole run minus the time its chunks spent
deleting, from the ledger); each method's time as a line through the two sizes (the per-row slope beside
the DELETE's, the time at 0 rows, the projection to ``--project-rows``); and the next night's run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import purge_benchmark as pb  # noqa: E402

from airflow_retention.demo.postgres import admin_execute, resolve_dsn  # noqa: E402

DB = "retention_dag_bench"
DELETE = "a. unbounded DELETE"
DAG = "e. whole DAG, scheduler + LocalExecutor, defaults"
NEXT_DATE = pb.RUN_DATE + timedelta(days=1)
NEXT_CUTOFF = pb.CUTOFF + timedelta(days=1)


def use_template(dsn: str, rows: int) -> None:
    """Make the table of ``rows`` rows the one ``purge_benchmark.measure`` copies (``bench.template``)."""
    admin_execute(
        dsn,
        "DO $$ BEGIN IF to_regclass('bench.template') IS NOT NULL THEN"
        " EXECUTE format('ALTER TABLE bench.template RENAME TO %I',"
        " (SELECT 'template_' || obj_description('bench.template'::regclass))); END IF; END $$",
        f"ALTER TABLE bench.template_{rows} RENAME TO template",
    )


def build_templates(dsn: str, sizes: list[int]) -> None:
    for rows in sizes:
        pb.build_template(dsn, rows)
        admin_execute(
            dsn, f"COMMENT ON TABLE bench.template IS '{rows}'", f"ALTER TABLE bench.template RENAME TO template_{rows}"
        )


def delete_next_night(dsn: str) -> dict[str, Any]:
    """The next logical date's unbounded DELETE on the table (a) left (no copy, no VACUUM in between)."""
    started = time.perf_counter()
    rows, _ = pb.unbounded(dsn, NEXT_CUTOFF)
    return {"seconds": round(time.perf_counter() - started, 2), "rows": rows}


def measure_delete(dsn: str) -> pb.Result:
    a = pb.measure(dsn, DELETE, lambda: pb.unbounded(dsn))
    a.notes["next_night"] = delete_next_night(dsn)
    return a


def next_night(scheduler: pb.Scheduler, dsn: str) -> dict[str, Any]:
    """The next logical date's run on the table the measured run left (no copy, no VACUUM in between)."""
    started = time.perf_counter()
    rows, notes = scheduler.purge("retention_bench", NEXT_DATE)
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT eligible_left, cleanup_lag_seconds, lag_measured_at IS NOT NULL FROM bench_ledger.runs"
            " WHERE cutoff = %s",
            (pb.CUTOFF,),
        )
        left, lag, measured = cur.fetchone()
        # The blocks the night's chunks cover (bounded by the timestamp index or the whole table).
        cur.execute(
            "SELECT coalesce(sum(c.hi - c.lo), 0), count(c.*),"
            " pg_relation_size('bench.events') / current_setting('block_size')::bigint"
            " FROM bench_ledger.runs r LEFT JOIN bench_ledger.chunks c USING (run_key) WHERE r.cutoff = %s",
            (NEXT_CUTOFF,),
        )
        blocks_planned, chunks, table_blocks = cur.fetchone()
    conn.close()
    return {
        "seconds": round(notes["seconds"], 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "rows": rows,
        "plan_task_s": notes["plan_task_s"],
        "fixed_cost": notes["fixed_cost"],
        "previous_run_lag_measured": bool(measured),
        "previous_run_eligible_left": left,
        "previous_run_lag_s": lag,
        "blocks_planned": int(blocks_planned),
        "table_blocks": int(table_blocks),
        "chunks": int(chunks),
    }


def median(results: list[pb.Result]) -> pb.Result:
    ordered = sorted(results, key=lambda r: r.seconds)
    chosen = ordered[len(ordered) // 2]
    if len(results) > 1:
        chosen.notes["all_seconds"] = [round(r.seconds, 2) for r in results]
    return chosen


def print_next_nights(sizes: list[int], chosen: dict[int, dict[str, pb.Result]]) -> None:
    print()
    print("the next night (one more day of rows), right after on the same table, no VACUUM in between: the")
    print("DAG's plan task also measures the first run's cleanup lag, which that run's verify left to it")
    print(
        f"{'table rows':>12} {'rows':>9} {'DELETE s':>9} {'DAG s':>7} {'x(a)':>6} {'(e) plan s':>11}"
        f" {'next plan s':>12} {'lag measured':>13} {'fixed s':>8} {'blocks read':>19}"
    )
    for rows in sizes:
        a, e = chosen[rows][DELETE].notes["next_night"], chosen[rows][DAG].notes["next_night"]
        measured = f"yes, {e['previous_run_eligible_left']} left" if e["previous_run_lag_measured"] else "no"
        print(
            f"{rows:>12,} {e['rows']:>9,} {a['seconds']:>9.2f} {e['seconds']:>7.2f} {e['seconds'] / a['seconds']:>6.1f}"
            f" {chosen[rows][DAG].notes['plan_task_s']:>11.2f} {e['plan_task_s']:>12.2f} {measured:>13}"
            f" {e['fixed_cost']['fixed']:>8.2f} {_blocks_read(e):>19}"
        )


def _blocks_read(night: dict[str, Any]) -> str:
    if "blocks_planned" not in night:
        return "-"
    share = 100.0 * night["blocks_planned"] / night["table_blocks"] if night["table_blocks"] else 0.0
    return f"{night['blocks_planned']:,} ({share:.1f} %)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[2_000_000, 10_000_000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--repeat", type=int, default=3, help="measurements per size and method; the median is kept")
    parser.add_argument("--project-rows", type=int, default=100_000_000, help="project the lines to this many rows")
    parser.add_argument("--dsn", help="PostgreSQL server (a database 'retention_dag_bench' is recreated on it)")
    parser.add_argument("--json", type=Path, default=BENCH / "results-dag.json")
    parser.add_argument(
        "--wal-compression", default="server", help="the bench policy's wal_compression (default: the policy default)"
    )
    parser.add_argument(
        "--airflow-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Airflow settings of the deployment, e.g. AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME=0.2",
    )
    args = parser.parse_args(argv)
    sizes = sorted(args.sizes)
    server = resolve_dsn(args.dsn)
    admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)', f'CREATE DATABASE "{DB}"')
    dsn = make_dsn(server, dbname=DB)
    runs: dict[int, dict[str, list[pb.Result]]] = {n: {DELETE: [], DAG: []} for n in sizes}
    airflow_env = dict(item.split("=", 1) for item in args.airflow_env)
    idle: dict[int, pb.Result] = {}
    loads: list[float] = []
    started = time.perf_counter()
    try:
        build_templates(dsn, sizes)
        use_template(dsn, sizes[0])
        # bench.events must exist before the scheduler's untimed warm-up run.
        runs[sizes[0]][DELETE].append(measure_delete(dsn))
        policy = pb.bench_policy(max_active_chunks=2, wal_compression=args.wal_compression)
        print("starting Airflow (scheduler, LocalExecutor, 2 chunk tasks at once) ...", flush=True)
        with pb.Scheduler(server, dsn, [policy], airflow_env) as scheduler:
            for rep in range(args.repeat):
                for rows in sizes:
                    use_template(dsn, rows)
                    if rows not in idle:
                        idle[rows] = pb.measure(dsn, "idle", lambda: (time.sleep(5), (0, {}))[1], purges=False)
                    loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
                    print(f"[{rep + 1}/{args.repeat}] {rows:,} rows: (a), then (e) and the next night ...", flush=True)
                    if not (rep == 0 and rows == sizes[0]):
                        runs[rows][DELETE].append(measure_delete(dsn))
                    e = pb.measure(dsn, DAG, lambda: scheduler.purge("retention_bench"))
                    e.notes["next_night"] = next_night(scheduler, dsn)
                    runs[rows][DAG].append(e)
    finally:
        admin_execute(server, f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    chosen = {rows: {m: median(rs) for m, rs in by.items()} for rows, by in runs.items()}
    print(
        f"\n{args.repeat} repetition(s), medians; load average (1 min) at each measurement"
        f" {min(loads):.1f}-{max(loads):.1f}; whole benchmark {time.perf_counter() - started:.0f} s"
    )
    for rows in sizes:
        pb.print_table(rows, idle[rows], [chosen[rows][DELETE], chosen[rows][DAG]])
    # One column per size: print_fixed_costs names a column by what follows "at once, " in the method.
    pb.print_fixed_costs([replace(chosen[rows][DAG], method=f"at once, {rows:,} rows") for rows in sizes])
    small, large = sizes
    other = {"rows": small, "results": [asdict(r) for r in chosen[small].values()]}
    lines = pb.slopes(large, list(chosen[large].values()), other, args.project_rows)
    pb.print_slopes(lines, "both sizes in this run")
    print_next_nights(sizes, chosen)
    pb.write_json(
        args.json,
        {
            "sizes": sizes,
            "repeat": args.repeat,
            "airflow_env": airflow_env,
            "wal_compression": args.wal_compression,
            "load_average": [min(loads), max(loads), statistics.median(loads)],
            "idle": {rows: asdict(r) for rows, r in idle.items()},
            "results": {rows: {m: asdict(r) for m, r in by.items()} for rows, by in chosen.items()},
            "all": {rows: {m: [asdict(r) for r in rs] for m, rs in by.items()} for rows, by in runs.items()},
            "slopes": lines,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
