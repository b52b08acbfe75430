"""The demo: seed the example tables, run every example retention DAG for consecutive nights, then a
backfill of two missed days, and print what the ledger shows plus a check of the tables.

    python -m airflow_retention.demo [--dsn DSN] [--home DIR] [--dags DIR] [--database NAME]

PostgreSQL: ``--dsn`` or ``$RETENTION_TEST_DSN``, else the local server, else a throwaway embedded one.
The demo works in a database of its own (``retention_demo``, recreated) on that server. Airflow runs
on its embedded defaults (SQLite metadata) in a throwaway home, through ``dag.test()``. The DAG file and
the example policies are the ones ``airflow-retention init`` writes, shipped with the package.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEMO_DB = "retention_demo"
ANCHOR = "2026-06-10"
NIGHTLY = ["2026-06-01", "2026-06-02", "2026-06-03", "2026-06-06"]
MISSED = ["2026-06-04", "2026-06-05"]
EXIT_ERROR = 2


class DemoInputError(Exception):
    """An input the demo checks before it drops or creates anything: one line, exit 2."""


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
    parser.add_argument("--dsn", help=f"PostgreSQL server to use (a database {DEMO_DB!r} is created on it)")
    parser.add_argument("--home", type=Path, help="AIRFLOW_HOME to use (default: a new temporary directory)")
    parser.add_argument(
        "--dags",
        type=Path,
        help="a dags folder holding retention_dags.py and retention_policies.yaml (default: the files"
        " `airflow-retention init` writes, written into <home>/dags)",
    )
    parser.add_argument("--database", default=DEMO_DB, help=f"the database to drop and create (default {DEMO_DB})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        setup = prepare(args)
    except DemoInputError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        print("demo: nothing was dropped or created", file=sys.stderr)
        return EXIT_ERROR
    return run(setup, started)


@dataclass
class Setup:
    dsn: str
    home: Path
    dags: Path
    log: Path
    policies: list[Any]
    bag: Any


def prepare(args: argparse.Namespace) -> Setup:
    """Every input checked, in order, before anything is dropped or created: the database name, the
    server (it answers; the role may create databases), the policies file (exists, parses) and the DAGs
    (they import). Then the demo's database is dropped and created."""
    from airflow_retention.demo.postgres import resolve_dsn

    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", args.database):
        raise DemoInputError(f"--database {args.database!r}: lower-case letters, digits and _ only (at most 63)")
    try:
        server = resolve_dsn(args.dsn)
    except RuntimeError as exc:
        raise DemoInputError(str(exc)) from None
    check_can_create_database(server)

    from psycopg2.extensions import make_dsn

    dsn = make_dsn(server, dbname=args.database)
    home = (args.home or Path(tempfile.mkdtemp(prefix="retention-demo-"))).absolute()
    home.mkdir(parents=True, exist_ok=True)
    log = home / "demo-airflow.log"
    dags = args.dags.absolute() if args.dags else write_dags(home / "dags")
    example = dags / "retention_policies.yaml"
    if not (dags / "retention_dags.py").is_file() or not example.is_file():
        raise DemoInputError(f"--dags {dags}: needs retention_dags.py and retention_policies.yaml in it")

    import yaml

    from airflow_retention.core.errors import RetentionError
    from airflow_retention.core.policy.loading import load_policies

    try:
        policies = load_policies(demo_policies(example, home / "retention_policies.yaml"))
    except (RetentionError, yaml.YAMLError) as exc:
        raise DemoInputError(f"{example}: {exc}") from None
    say(f"PostgreSQL: {redact(dsn)}")
    say(f"Airflow home: {home} (SQLite metadata), DAGs from {dags}")
    say(f"Airflow's own output (task logs, warnings): {log}")

    import subprocess

    with airflow_output(log):
        from airflow_retention.demo.airflow_home import prepare_airflow_home

        try:
            prepare_airflow_home(home, dags, dsn)  # before anything imports Airflow
        except subprocess.CalledProcessError:
            raise DemoInputError(f"airflow db migrate failed: its output is in {log}") from None
        from airflow_retention.compat import dagbag

        bag = dagbag(str(dags))
    if bag.import_errors:
        raise DemoInputError(f"DAG import errors: {bag.import_errors}")
    missing = [p.name for p in policies if f"retention_{p.name}" not in bag.dags]
    if missing:
        raise DemoInputError(f"no DAG in {dags} for the policies {', '.join(missing)}")

    recreate_database(server, args.database)
    return Setup(dsn=dsn, home=home, dags=dags, log=log, policies=policies, bag=bag)


def run(setup: Setup, started: float) -> int:
    import psycopg2

    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.planning.cutoff import format_cutoff, freeze_cutoff, run_key
    from airflow_retention.demo.seed import seed_examples, snapshot, utc_day

    policies = setup.policies
    conn = psycopg2.connect(setup.dsn)
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

    lines: list[RunLine] = []
    for kind, batch in (("nightly", NIGHTLY), ("backfill", MISSED)):
        if kind == "backfill":
            say_missed(conn, policies)
        for day in batch:
            for policy in policies:
                dag = setup.bag.dags[f"retention_{policy.name}"]
                t0 = time.perf_counter()
                with airflow_output(setup.log):
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
        say(f"Airflow's task logs: {setup.log}")
        return 1
    say("all checks passed")
    return 0


def say_missed(conn: Any, policies: list[Any]) -> None:
    """What each policy's verify task of the last night warned about: the nights not complete in the ledger."""
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.running.verify import missed_runs

    missed = {
        p.name: [m.anchor.date().isoformat() for m in missed_runs(conn, Ledger(p.ledger_schema), p, *nights())]
        for p in policies
    }
    found = sorted({day for days in missed.values() for day in days})
    say(
        f"verify of {NIGHTLY[-1]} found {len(found)} night(s) not complete in the ledger"
        f" ({', '.join(found) or 'none'}), for {sum(bool(d) for d in missed.values())} of {len(policies)} policies"
    )
    say(f"the scheduler was paused on {' and '.join(MISSED)}: backfilling the two missed days")


def nights() -> tuple[Any, Any]:
    from airflow_retention.demo.seed import utc_day

    return utc_day(NIGHTLY[0]), utc_day(NIGHTLY[-1])


def write_dags(folder: Path) -> Path:
    """The DAG file and the example policies, as ``airflow-retention init`` writes them."""
    from airflow_retention.scaffold import write_scaffold

    write_scaffold(folder, force=True)
    return folder


def check_can_create_database(server_dsn: str) -> None:
    import psycopg2

    with psycopg2.connect(server_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cur.fetchone()
    conn.close()
    if not (row and row[0]):
        raise DemoInputError(f"the role of {redact(server_dsn)} may not create databases (CREATEDB)")


@contextmanager
def airflow_output(log: Path) -> Iterator[None]:
    """Send everything written to stdout and stderr, by this process and its children, to ``log``:
    Airflow's task logs and third-party warnings, so that the terminal shows the report and the checks.
    File descriptors, not ``sys.stdout``: Airflow's loggers and ``airflow db migrate`` hold their own."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with log.open("ab") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def demo_policies(example: Path, copy: Path) -> Path:
    """The example policies starting on the demo's first night, read by the DAG file through
    ``AIRFLOW_RETENTION_POLICIES``: the verify tasks then report exactly the two nights the demo skips."""
    import yaml

    doc = yaml.safe_load(example.read_text())
    if not isinstance(doc, dict):
        raise yaml.YAMLError("not a mapping with 'policies' (and optionally 'defaults')")
    doc.setdefault("defaults", {})["start_date"] = NIGHTLY[0]
    copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.environ["AIRFLOW_RETENTION_POLICIES"] = str(copy)
    return copy


def checks(
    conn: Any, policies: list[Any], before: dict[str, Any], cutoffs: dict[str, Any], lines: list[RunLine]
) -> list[str]:
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.running.verify import missed_runs
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
        missed = missed_runs(conn, Ledger(policy.ledger_schema), policy, *nights())
        results.append((not missed, f"no night from {NIGHTLY[0]} to {NIGHTLY[-1]} missing (found {len(missed)})"))
        if policy.archive_table is not None:
            archived = dbapi_count(conn, policy.archive_table.sql)
            results.append((archived == deleted, f"archive {policy.archive_table} holds the {archived:,} deleted rows"))
        for ok, text in results:
            say(f"  [{'ok' if ok else 'FAIL'}] {policy.name}: {text}")
            if not ok:
                failures.append(f"{policy.name}: {text}")
    return failures


def dbapi_count(conn: Any, table_sql: str) -> int:
    from airflow_retention.core.db import dbapi

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
