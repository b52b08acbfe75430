"""A purge of an otherwise idle server that also holds Airflow's metadata database: does the scheduler's
session hold the purge at the budget's floor? In one run, side by side.

    python benchmarks/metadata_beside_benchmark.py [--rows 2000000] [--dsn DSN] [--json out.json]

The budget benchmark's table (``--rows`` rows, about 56 % eligible, 4 chunks) in its database, and beside it
a database standing for Airflow's metadata (``retention_budget_meta``) in which one session writes a
heartbeat row every 0.5 s, as a scheduler does. One worker purges with the new defaults:

- with no other session on the server (the reference);
- beside the heartbeat, the defaults (what a chunk task did before it ignored the metadata database);
- beside the heartbeat, ``budget.ignore_databases: [retention_budget_meta]`` (what a chunk task now sets by
  itself when Airflow's ``sql_alchemy_conn`` is on the target's server);
- beside the heartbeat, ``budget.max_wal_rate: false`` (the workaround before).

Each prints its wall time against the reference's, its rows/s, the budget's levels and its pauses.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import budget_benchmark as bb  # noqa: E402
import purge_benchmark as pb  # noqa: E402

META = "retention_budget_meta"
HEARTBEAT_S = 0.5


class Heartbeat(threading.Thread):
    """A scheduler's session: a one-row upsert every :data:`HEARTBEAT_S` in the metadata stand-in."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.halt = dsn, threading.Event()

    def run(self) -> None:
        conn = psycopg2.connect(self.dsn, application_name="scheduler-stand-in")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS heartbeat (id integer PRIMARY KEY, at timestamptz)")
            while not self.halt.wait(HEARTBEAT_S):
                cur.execute("INSERT INTO heartbeat VALUES (1, now()) ON CONFLICT (id) DO UPDATE SET at = now()")
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dsn", help="PostgreSQL server (databases of this benchmark are recreated on it)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    server = bb.resolve_dsn(args.dsn)
    bb.admin_execute(server, f'DROP DATABASE IF EXISTS "{bb.DB}" WITH (FORCE)', f'CREATE DATABASE "{bb.DB}"')
    bb.admin_execute(server, f'DROP DATABASE IF EXISTS "{META}" WITH (FORCE)', f'CREATE DATABASE "{META}"')
    dsn = make_dsn(server, dbname=bb.DB)
    pb.build_template(dsn, args.rows)
    bb.pgbench_init(dsn, 1)  # prepare() resets pgbench's tables before each case
    chunk_rows = max(1, int(args.rows * bb.ELIGIBLE_SHARE / 4))
    cases: list[tuple[str, bool, dict[str, Any]]] = [
        ("no other session", False, {}),
        ("beside the heartbeat, defaults", True, {}),
        (f"beside the heartbeat, ignore_databases [{META}]", True, {"budget": {"ignore_databases": [META]}}),
        ("beside the heartbeat, max_wal_rate false", True, {"budget": {"max_wal_rate": False}}),
    ]
    results = []
    for name, beside, fields in cases:
        policy = bb.policy_with(chunk_rows=chunk_rows, **fields)
        bb.prepare(dsn, "bench_ledger")
        heartbeat = Heartbeat(make_dsn(server, dbname=META))
        if beside:
            heartbeat.start()
            time.sleep(2 * HEARTBEAT_S)
        since = datetime.now(timezone.utc)
        began = time.time()
        try:
            rows, notes = bb.engine(dsn, policy, 1)
        finally:
            heartbeat.halt.set()
        seconds = time.time() - began
        budget = bb.budget_summary(dsn, since)
        results.append(
            {"case": name, "seconds": round(seconds, 1), "rows": rows, "rows_per_s": round(rows / seconds),
             "paused_s": notes["paused_s"], "levels": budget.get("levels"), "moves": budget.get("moves")}
        )  # fmt: skip
        print(f"  {name}: {seconds:.1f} s, {rows:,} rows; paused {notes['paused_s']}", flush=True)
    reference = results[0]["seconds"]
    print(f"\n{'case':<55} {'s':>7} {'x ref':>6} {'rows/s':>9}  levels (one per observation)")
    for r in results:
        levels = r["levels"] or []
        shown = " ".join(map(str, levels[:12])) + (" …" if len(levels) > 12 else "")
        print(f"{r['case']:<55} {r['seconds']:>7} {r['seconds'] / reference:>6.2f} {r['rows_per_s']:>9,}  {shown}")
    if args.json:
        pb.write_json(args.json, {"rows": args.rows, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
