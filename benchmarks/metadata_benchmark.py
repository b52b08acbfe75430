"""``airflow db clean`` beside the metadata policies (issue 23), on identical data, in one run.

A metadata database migrated by the installed Airflow and filled with a realistic mix
(``airflow_retention.demo.airflow_metadata``) is cloned; ``airflow db clean --skip-archive`` runs in one
copy (and, with ``--batch-size``, ``db clean --batch-size N`` in another), the policies generated from the
installed Airflow's cleanup configuration in the last, one table after another in ``db clean``'s order.
Printed side by side: wall time, the longest transaction and the longest one that wrote (sampled every
20 ms in ``pg_stat_activity``)
and the WAL written (``pg_current_wal_lsn()`` before and after: the server's whole WAL, so run it on an
otherwise idle server). The rows left must be identical, table by table (a checksum of every row); the
script exits 1 otherwise.

    python benchmarks/metadata_benchmark.py --log-rows 1000000
    python benchmarks/metadata_benchmark.py --log-rows 10000000 --batch-size 100000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import yaml
from psycopg2.extensions import make_dsn

from airflow_retention.demo import airflow_metadata as am
from airflow_retention.demo.postgres import admin_execute, resolve_dsn
from airflow_retention.metadata import metadata_policies, parse_settings
from airflow_retention.scaffold import METADATA_SETTINGS_FILE
from airflow_retention.scaffold import source as scaffold_source

RETENTION_DAYS = 30


class LongestTransaction:
    """The longest open transaction of a database while it runs, and the longest one that wrote (holds a
    transaction id: row locks), sampled from ``pg_stat_activity``."""

    def __init__(self, server_dsn: str, dbname: str) -> None:
        self.server_dsn, self.dbname, self.longest, self.longest_write = server_dsn, dbname, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        conn = psycopg2.connect(self.server_dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            while not self._stop.is_set():
                cur.execute(
                    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0),"
                    " coalesce(max(extract(epoch FROM clock_timestamp() - xact_start))"
                    " FILTER (WHERE backend_xid IS NOT NULL), 0) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
                    (self.dbname,),
                )
                any_tx, writing = cur.fetchone()
                self.longest = max(self.longest, float(any_tx))
                self.longest_write = max(self.longest_write, float(writing))
                time.sleep(0.02)
        conn.close()

    def __enter__(self) -> LongestTransaction:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wal_lsn(dsn: str) -> int:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def measured(server: str, dsn: str, work: Callable[[], Any]) -> dict[str, float]:
    dbname = psycopg2.extensions.parse_dsn(dsn)["dbname"]
    admin_execute(server, "CHECKPOINT")  # every tool starts after a checkpoint: full-page images alike
    before = wal_lsn(server)
    started = time.monotonic()
    with LongestTransaction(server, dbname) as longest:
        work()
    return {
        "seconds": round(time.monotonic() - started, 2),
        "longest_transaction_s": round(longest.longest, 2),
        "longest_write_s": round(longest.longest_write, 2),
        "wal_mb": round((wal_lsn(server) - before) / 2**20, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-rows", type=int, default=1_000_000)
    parser.add_argument("--dags", type=int, default=50)
    parser.add_argument("--days", type=int, default=180, help="days of daily runs (and of log rows)")
    parser.add_argument("--batch-size", type=int, help="also run db clean --batch-size N in a copy of its own")
    parser.add_argument("--dsn", default=None, help="the PostgreSQL server (default: RETENTION_TEST_DSN or local)")
    parser.add_argument("--json", type=Path, help="write the results to this file too")
    args = parser.parse_args()

    server = args.dsn or resolve_dsn()
    anchor = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    run_date = anchor.replace(hour=0)
    cutoff = run_date - timedelta(days=RETENTION_DAYS)
    home = Path(tempfile.mkdtemp(prefix="metadata-benchmark-"))
    names = {"source": "retention_metadata_bench", "db clean": "retention_metadata_bench_dbclean"}
    if args.batch_size:
        names[f"db clean --batch-size {args.batch_size}"] = "retention_metadata_bench_batched"
    names["policies"] = "retention_metadata_bench_policies"
    admin_execute(server, *[f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in names.values()])
    admin_execute(server, f'CREATE DATABASE "{names["source"]}"')
    source = make_dsn(server, dbname=names["source"])
    try:
        am.migrate(home, source)
        started = time.monotonic()
        shape = am.MetadataShape(dags=args.dags, days=args.days, log_rows=args.log_rows, job_rows=args.log_rows // 50)
        seeded = am.seed_metadata(source, anchor, shape)
        print(f"seeded in {time.monotonic() - started:.0f} s: {json.dumps(seeded)}", flush=True)
        copies = {tool: am.clone_database(source, db) for tool, db in names.items() if tool != "source"}
        results: dict[str, dict[str, float]] = {}
        for tool, dsn in copies.items():
            if tool == "policies":
                # The settings init --airflow-metadata writes (batches of about 500 ms), at this retention.
                scaffold = parse_settings(yaml.safe_load(scaffold_source(METADATA_SETTINGS_FILE)), "scaffold")
                settings = dataclasses.replace(scaffold, retention=f"{RETENTION_DAYS} days")
                policies = metadata_policies(settings, am.existing_tables(dsn))
                results[tool] = measured(server, dsn, lambda d=dsn, p=policies: am.run_policies(d, p, run_date))
            else:
                extra = ("--batch-size", str(args.batch_size)) if "batch" in tool else ()
                results[tool] = measured(server, dsn, lambda d=dsn, e=extra: am.db_clean(home, d, cutoff, *e))
            print(f"{tool}: {results[tool]}", flush=True)
        sums = {tool: am.checksums(dsn, anchor) for tool, dsn in copies.items()}
        left = am.table_counts(copies["policies"])
    finally:
        admin_execute(server, *[f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in names.values()])

    # db clean's wall time includes starting Airflow's CLI (the policies run in this process, Airflow
    # already imported): measured apart, once.
    started = time.monotonic()
    am.airflow_cli(home, source, "version")
    cli_start = round(time.monotonic() - started, 2)
    reference = results["db clean"]
    print(f"\nlog rows {args.log_rows:,}; {args.dags} DAGs x {args.days} days of runs; retention {RETENTION_DAYS} days")
    print(f"{'tool':<34}{'wall s':>9}{'ratio':>7}{'longest tx s':>14}{'longest write s':>17}{'WAL MB':>9}")
    for tool, r in results.items():
        ratio = r["seconds"] / reference["seconds"] if reference["seconds"] else float("nan")
        print(
            f"{tool:<34}{r['seconds']:>9.1f}{ratio:>7.2f}{r['longest_transaction_s']:>14.2f}"
            f"{r['longest_write_s']:>17.2f}{r['wal_mb']:>9.1f}"
        )
    print(f"(db clean's times include starting the airflow CLI: {cli_start:.1f} s, as `airflow version` took)")
    same = all(sums[tool] == sums["db clean"] for tool in sums)
    print("rows left:", "identical in every table" if same else "DIFFERENT", json.dumps(left))
    if not same:
        for table in sums["db clean"]:
            print(f"  {table}: " + ", ".join(f"{tool} {sums[tool][table]}" for tool in sums))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "log_rows": args.log_rows,
                    "seeded": seeded,
                    "results": results,
                    "cli_start_s": cli_start,
                    "identical": same,
                },
                indent=2,
            )
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
