"""The demo: seed the example tables, run every example retention DAG for consecutive nights, then a
backfill of two missed days, and print what the ledger shows plus a check of the tables.

    python -m airflow_retention.demo [--dsn DSN] [--home DIR]

PostgreSQL: ``--dsn`` or ``$RETENTION_TEST_DSN``, else the local server, else a throwaway embedded one.
The demo works in a database of its own (``retention_demo``, recreated) on that server. Airflow runs
on its embedded defaults (SQLite metadata) in a throwaway home, through ``dag.test()``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_retention.demo.postgres import resolve_dsn

DEMO_DB = "retention_demo"
ANCHOR = "2026-06-10"
NIGHTLY = ["2026-06-01", "2026-06-02", "2026-06-03", "2026-06-06"]
MISSED = ["2026-06-04", "2026-06-05"]


@dataclass
class RunLine:
    policy: str
    day: str
    kind: str
    cutoff: str
    chunks: int
    rows: int
    seconds: float
    ledger_seconds: float
    state: str


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_retention.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="PostgreSQL server to use (a database 'retention_demo' is created on it)")
    parser.add_argument("--home", type=Path, help="AIRFLOW_HOME to use (default: a new temporary directory)")
    parser.add_argument("--dags", type=Path, default=Path(__file__).resolve().parents[2] / "dags")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()

    server = resolve_dsn(args.dsn)
    dsn = recreate_database(server, DEMO_DB)
    home = args.home or Path(tempfile.mkdtemp(prefix="retention-demo-"))
    say(f"PostgreSQL: {redact(dsn)}")
    say(f"Airflow home: {home} (SQLite metadata), DAGs from {args.dags}")

    from airflow_retention.demo.airflow_home import prepare_airflow_home

    prepare_airflow_home(home, args.dags, dsn)  # before anything imports Airflow
    policies_file = demo_policies(args.dags / "retention_policies.yaml", home / "retention_policies.yaml")

    import psycopg2

    from airflow_retention.core.cutoff import format_cutoff, freeze_cutoff, run_key
    from airflow_retention.core.ledger import Ledger
    from airflow_retention.core.policy import load_policies
    from airflow_retention.demo.seed import seed_examples, snapshot, utc_day

    policies = load_policies(policies_file)
    conn = psycopg2.connect(dsn)
    days = NIGHTLY + MISSED
    # Airflow 3's @daily runs (and backfills) of day D have logical date = data interval end = D midnight,
    # so their cutoff is D minus the retention. The report looks each run up by that key.
    cutoffs = {p.name: {d: freeze_cutoff(p, utc_day(d)) for d in days} for p in policies}
    seed_examples(conn, utc_day(ANCHOR), {name: c.values() for name, c in cutoffs.items()})
    before = {p.name: snapshot(conn, p, max(cutoffs[p.name].values())) for p in policies}
    say(
        "seeded: "
        + ", ".join(f"{s.table} {s.total:,} rows ({s.eligible:,} eligible by the last cutoff)" for s in before.values())
    )

    from airflow_retention.compat import dagbag

    bag = dagbag(str(args.dags))
    if bag.import_errors:
        say(f"DAG import errors: {bag.import_errors}")
        return 1
    lines: list[RunLine] = []
    for kind, batch in (("nightly", NIGHTLY), ("backfill", MISSED)):
        if kind == "backfill":
            say(f"the scheduler was paused on {' and '.join(MISSED)}: backfilling the two missed days")
        for day in batch:
            for policy in policies:
                dag = bag.dags[f"retention_{policy.name}"]
                t0 = time.perf_counter()
                dag_run = dag.test(logical_date=utc_day(day))
                seconds = time.perf_counter() - t0
                run = Ledger(policy.ledger_schema).get_run(conn, run_key(policy, cutoffs[policy.name][day]))
                lines.append(
                    RunLine(
                        policy=policy.name,
                        day=day,
                        kind=kind,
                        cutoff=format_cutoff(cutoffs[policy.name][day]),
                        chunks=run["chunks_expected"] if run else 0,
                        rows=(run["rows_deleted"] or 0) if run else 0,
                        seconds=seconds,
                        ledger_seconds=ledger_duration(run),
                        state=f"{dag_run.state} / ledger {run['state'] if run else 'missing'}",
                    )
                )
                print_line(lines[-1])
    failures = checks(conn, policies, before, cutoffs, lines)
    print_summary(lines)
    say(f"demo finished in {time.perf_counter() - started:.0f} s")
    if failures:
        for failure in failures:
            say(f"CHECK FAILED: {failure}")
        return 1
    say("all checks passed")
    return 0


def demo_policies(example: Path, copy: Path) -> Path:
    """The example policies starting on the demo's first night, read by the DAG file through
    ``AIRFLOW_RETENTION_POLICIES``: the verify tasks then report exactly the two nights the demo skips."""
    import os

    import yaml

    doc = yaml.safe_load(example.read_text())
    doc.setdefault("defaults", {})["start_date"] = NIGHTLY[0]
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.environ["AIRFLOW_RETENTION_POLICIES"] = str(copy)
    return copy


def checks(
    conn: Any, policies: list[Any], before: dict[str, Any], cutoffs: dict[str, Any], lines: list[RunLine]
) -> list[str]:
    from airflow_retention.core.ledger import Ledger
    from airflow_retention.demo.seed import snapshot

    say("")
    say("checks")
    failures = []
    for policy in policies:
        expected = before[policy.name]
        after = snapshot(conn, policy, max(cutoffs[policy.name].values()))
        deleted = sum(line.rows for line in lines if line.policy == policy.name)
        results = [
            (after.eligible == 0, f"no eligible row left in {after.table} (found {after.eligible})"),
            (
                after.total == expected.keep_count and after.keep_checksum == expected.keep_checksum,
                f"every row that must stay is still there ({after.total:,} of {expected.keep_count:,}, key checksum"
                f" {'equal' if after.keep_checksum == expected.keep_checksum else 'DIFFERENT'})",
            ),
            (
                deleted == expected.total - expected.keep_count,
                f"ledger rows deleted {deleted:,} = rows gone {expected.total - expected.keep_count:,}",
            ),
        ]
        runs = [r for r in Ledger(policy.ledger_schema).recent_runs(conn, policy.name)]
        results.append((all(r["state"] == "complete" for r in runs), f"all {len(runs)} runs complete in the ledger"))
        if policy.archive_table is not None:
            archived = dbapi_count(conn, policy.archive_table.sql)
            results.append((archived == deleted, f"archive {policy.archive_table} holds the {archived:,} deleted rows"))
        for ok, text in results:
            say(f"  [{'ok' if ok else 'FAIL'}] {policy.name}: {text}")
            if not ok:
                failures.append(f"{policy.name}: {text}")
    return failures


def dbapi_count(conn: Any, table_sql: str) -> int:
    from airflow_retention.core import dbapi

    return int(dbapi.fetch_all(conn, f"SELECT count(*) FROM {table_sql}")[0][0])


def recreate_database(server_dsn: str, name: str) -> str:
    from psycopg2.extensions import make_dsn

    from airflow_retention.demo.postgres import admin_execute

    admin_execute(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"')
    return make_dsn(server_dsn, dbname=name)


HEADER = (
    f"{'policy':<20} {'day':<10} {'kind':<8} {'cutoff':<20} {'chunks':>6} {'rows deleted':>12}"
    f" {'ledger s':>8} {'wall s':>6}  state"
)


def ledger_duration(run: dict[str, Any] | None) -> float:
    """Seconds from planning to verification, as the ledger recorded them."""
    if not run or not run["completed_at"]:
        return 0.0
    return (run["completed_at"] - run["planned_at"]).total_seconds()


def print_line(line: RunLine) -> None:
    if not getattr(print_line, "started", False):
        say("")
        say(HEADER)
        print_line.started = True  # type: ignore[attr-defined]
    say(
        f"{line.policy:<20} {line.day:<10} {line.kind:<8} {line.cutoff:<20} {line.chunks:>6} {line.rows:>12,}"
        f" {line.ledger_seconds:>8.2f} {line.seconds:>6.1f}  {line.state}"
    )


def print_summary(lines: list[RunLine]) -> None:
    say("")
    total = sum(line.rows for line in lines)
    say(f"{len(lines)} runs, {total:,} rows deleted, {sum(line.chunks for line in lines)} chunks")


def redact(dsn: str) -> str:
    from psycopg2.extensions import parse_dsn

    parts = parse_dsn(dsn)
    parts.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in parts.items())


def say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
