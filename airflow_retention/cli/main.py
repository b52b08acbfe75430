"""Argument parsing, logging and error handling of ``airflow-retention``; the commands are in
:mod:`airflow_retention.cli.commands`. Imports stay lazy so that ``--help`` answers at once."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from airflow_retention.cli.errors import EXIT_ERROR, CliError

PROG = "airflow-retention"
EPILOG = (
    "Policies: --policies, else $AIRFLOW_RETENTION_POLICIES, else dags/retention_policies.yaml. Database: --dsn,"
    " else the policy's conn_id from $AIRFLOW_CONN_<CONN_ID> (URI or JSON), else Airflow's own connection lookup"
    " when Airflow is configured. Exit codes: 0 ok, 1 verify found the run incomplete, 2 error."
)


def _common(defaults: bool) -> argparse.ArgumentParser:
    """Options accepted before and after the subcommand (after it, only when given)."""
    parser = argparse.ArgumentParser(add_help=False)

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--policies", metavar="PATH", default=default(None), help="the policies YAML file")
    parser.add_argument(
        "--dsn", metavar="DSN", default=default(None), help="libpq DSN or URL of the target database (every policy)"
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="machine-readable JSON output, no tables"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default(False), help="log the core's info messages"
    )
    return parser


def _date_options(parser: argparse.ArgumentParser, required: bool) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument(
        "--date",
        metavar="D",
        help="the run's date (data interval end / logical date): YYYY-MM-DD (midnight UTC) or ISO datetime;"
        " cutoff = D - retention",
    )
    group.add_argument("--cutoff", metavar="C", help="the cutoff itself (ISO 8601; no zone means UTC)")


def build_parser() -> argparse.ArgumentParser:
    from airflow_retention import __version__
    from airflow_retention.cli import commands

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and prepare the retention ledger: status, dry-run plans, verification.",
        epilog=EPILOG,
        parents=[_common(True)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common(False)

    status = sub.add_parser(
        "status", parents=[common], help="last runs, progress and warnings per policy", epilog=EPILOG
    )
    status.add_argument("policy", nargs="*", metavar="POLICY", help="policies to show (default: all)")
    status.add_argument("--limit", type=int, default=5, metavar="N", help="runs per policy (default 5)")
    status.add_argument(
        "--as-of", metavar="D", help="check missed scheduled runs as of this date (default: the database's now)"
    )
    status.add_argument("--watch", action="store_true", help="progress bars of every running purge until done")
    status.add_argument("--follow", metavar="RUN_KEY", help="progress bar of one run until its chunks are complete")
    status.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh period (default 1 s)")
    status.add_argument("--iterations", type=int, metavar="N", help="stop following after N refreshes")
    status.set_defaults(handler=commands.cmd_status)

    plan = sub.add_parser(
        "plan", parents=[common], help="dry-run plan of a run: chunks and row counts; writes nothing", epilog=EPILOG
    )
    plan.add_argument("policy", metavar="POLICY")
    _date_options(plan, required=True)
    plan.add_argument("--max-chunks", type=int, default=1024, metavar="N", help="Airflow's max_map_length (1024)")
    plan.add_argument("--chunks", type=int, default=50, metavar="N", help="chunks listed in the table (default 50)")
    plan.set_defaults(handler=commands.cmd_plan)

    verify = sub.add_parser(
        "verify",
        parents=[common],
        help="expected vs completed chunks of a run; exit 1 when incomplete",
        epilog=EPILOG,
    )
    verify.add_argument("policy", metavar="POLICY")
    _date_options(verify, required=False)
    verify.add_argument("--leftovers", action="store_true", help="also count eligible rows left before the cutoff")
    verify.add_argument("--chunks", type=int, default=50, metavar="N", help="incomplete chunks listed (default 50)")
    verify.set_defaults(handler=commands.cmd_verify)

    scaffold = sub.add_parser(
        "init",
        help="write the DAG file and an example policies file into a dags folder; print the next steps",
        description="Write retention_dags.py (one DAG per policy) and retention_policies.yaml (commented"
        " example policies) into DAGS_FOLDER, then print the next steps: connection, pool, a first dry run.",
    )
    scaffold.add_argument("dags_folder", metavar="DAGS_FOLDER", help="the Airflow dags folder (created if missing)")
    scaffold.add_argument("--force", action="store_true", help="overwrite the two files if they exist")
    scaffold.add_argument(
        "--airflow-metadata",
        action="store_true",
        help="instead: the DAG and settings that purge Airflow's own metadata database like airflow db clean",
    )
    scaffold.set_defaults(handler=commands.cmd_init)

    init = sub.add_parser(
        "init-ledger", parents=[common], help="create or migrate the ledger; print its version", epilog=EPILOG
    )
    init.add_argument("policy", nargs="*", metavar="POLICY", help="ledgers of these policies (default: all)")
    init.add_argument("--schema", help="with --dsn: the ledger schema to create (instead of the policies')")
    init.set_defaults(handler=commands.cmd_init_ledger)
    return parser


class _Lowercase(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def _logging(verbose: bool) -> Callable[[], None]:
    """Core warnings (grown chunks, NULL tenants, skipped policies) to stderr; returns the undo."""
    logger = logging.getLogger("airflow_retention")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lowercase())
    previous = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]

    return undo


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit code (0 ok, 1 incomplete run, 2 error, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    undo = _logging(args.verbose)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        return _fail(args, str(exc), exc.code)
    except Exception as exc:  # expected database and policy errors become one line
        if not _expected(exc):
            raise
        return _fail(args, str(exc) or type(exc).__name__, EXIT_ERROR)
    finally:
        undo()


def _expected(exc: BaseException) -> bool:
    """The core's own errors and the driver's: a message is enough, a traceback would be noise."""
    from airflow_retention.core.db.dbapi import is_driver_error
    from airflow_retention.core.errors import RetentionError

    return isinstance(exc, RetentionError) or is_driver_error(exc)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    line = " ".join(message.split())
    print(f"{PROG}: error: {line}", file=sys.stderr)
    if getattr(args, "json", False):
        from airflow_retention.cli.render import emit_json

        emit_json({"error": line, "exit_code": code})
    return code


if __name__ == "__main__":
    sys.exit(main())
