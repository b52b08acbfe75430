"""What the Retention view shows, read from each policy's ledger through the policy's Airflow connection.

The numbers come from the code behind ``airflow-retention status`` (:mod:`airflow_retention.cli.report`), so
the view and the command never disagree. Policies come from where the DAG file reads them:
``$AIRFLOW_RETENTION_POLICIES``, else ``retention_policies.yaml`` in the dags folder. A policy whose
database cannot be reached, or whose ledger cannot be read, gets a message instead of its numbers; the
other policies are still shown. Nothing here writes: the view's sessions are read-only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow_retention.cli.config import POLICIES_ENV, Target, connect, target_for
from airflow_retention.cli.report import PolicyStatus, backfill_command, database_now
from airflow_retention.cli.runs import RunSummary, summarize_run
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.policy.model import RetentionPolicy, policy_dag_id
from airflow_retention.plugins.budget import BudgetView, RunBudget, RunPoint, load_budget, run_points, span_end

# Runs per policy in the chart (and read from the ledger); the table shows the newest RUNS_IN_TABLE of them.
RUNS_SHOWN = 30
RUNS_IN_TABLE = 10
# The metadata DAG file's own variable (airflow_retention/scaffold/retention_airflow_metadata.py).
METADATA_ENV = "AIRFLOW_RETENTION_METADATA"
# A page must not hang on a slow ledger query.
STATEMENT_TIMEOUT = "15s"


def policies_file() -> Path:
    """The policies file the DAG file reads: ``$AIRFLOW_RETENTION_POLICIES``, else ``retention_policies.yaml``
    in Airflow's dags folder (where ``airflow-retention init`` writes it)."""
    from airflow_retention.scaffold import POLICIES_FILE

    return _in_dags_folder(POLICIES_ENV, POLICIES_FILE)


def _in_dags_folder(env: str, name: str) -> Path:
    """``$env`` when set, else the file ``name`` in Airflow's dags folder."""
    value = os.environ.get(env)
    if value:
        return Path(value)
    from airflow_retention.compat import conf

    return Path(conf.get("core", "dags_folder")) / name


@dataclass(frozen=True)
class PolicyProblem:
    """An invalid entry of the policies file (or a file that cannot be read), and the DAG it is shown under:
    ``retention_<name>``, or ``retention_invalid_policies`` when the entry has no usable name. A user sees
    it only if they may read that DAG."""

    dag_id: str
    message: str


@dataclass(frozen=True)
class PolicySet:
    """The valid policies of the file and a problem for each one left out (or for a file that cannot be read)."""

    # None: not shown (the view hides the file's path from a user who may see nothing that came from it).
    source: Path | None
    policies: list[RetentionPolicy]
    problems: list[PolicyProblem] = field(default_factory=list)


def read_policies(path: Path | None = None) -> PolicySet:
    from airflow_retention.core.errors import PolicyError
    from airflow_retention.core.policy.loading import load_policies_lenient, problem_dag_ids

    source = path or policies_file()
    try:
        policies, errors = load_policies_lenient(source)
    except PolicyError as exc:
        policies, errors = [], [exc]
    by_dag = problem_dag_ids([p.name for p in policies], errors)
    problems = [PolicyProblem(dag, message) for dag, messages in by_dag.items() for message in messages]
    if path is None:
        metadata, problem = metadata_policies_shown()
        policies = [*policies, *metadata]
        problems += [problem] if problem is not None else []
    return PolicySet(source, policies, problems)


def metadata_settings_file() -> Path:
    """The settings of the metadata database's DAG (``init --airflow-metadata``), as its DAG file finds them:
    ``$AIRFLOW_RETENTION_METADATA``, else ``retention_airflow_metadata.yaml`` in Airflow's dags folder."""
    from airflow_retention.scaffold import METADATA_SETTINGS_FILE

    return _in_dags_folder(METADATA_ENV, METADATA_SETTINGS_FILE)


def metadata_policies_shown() -> tuple[list[RetentionPolicy], PolicyProblem | None]:
    """The metadata database's policies (each table's), when its settings file exists; a problem under
    its DAG when the file is wrong, as the DAG file shows it."""
    from airflow_retention.metadata import METADATA_DAG_ID, load_settings, metadata_policies

    path = metadata_settings_file()
    if not path.is_file():
        return [], None
    try:
        return metadata_policies(load_settings(path)), None
    except Exception as exc:  # noqa: BLE001 - shown under the DAG, as its DAG file shows it
        return [], PolicyProblem(METADATA_DAG_ID, f"{path}: {exc}")


def dag_id(policy: RetentionPolicy) -> str:
    return policy_dag_id(policy)


@dataclass(frozen=True)
class PolicyPanel:
    """One policy as the view shows it: its status (runs newest first, missed days, warnings), or why not."""

    policy: RetentionPolicy
    status: PolicyStatus | None = None
    error: str | None = None
    # What only a user who may read the policy's connection sees: the driver's own words (host, port, user,
    # database), beside ``error``, which names nothing but the connection id.
    detail: str | None = None
    # The connection's host, user and database: blanked in the messages a non-reader of it sees.
    hidden: tuple[str, ...] = ()
    # The database budget's state (None: never observed, or a ledger older than its tables), each shown
    # run's pauses, hold and pressure, and why they could not be read.
    budget: BudgetView | None = None
    run_budgets: dict[str, RunBudget] = field(default_factory=dict)
    budget_error: str | None = None
    # The cleanup SLO (:class:`~airflow_retention.core.running.slo.CleanupSlo`, as ``status`` computed it):
    # None when the ledger has no complete run to learn it from (``slo_error`` says so).
    slo: Any | None = None
    slo_error: str | None = None

    def without_connection_details(self) -> PolicyPanel:
        """The panel as a user who may not read the policy's connection sees it."""
        status = self.status.without_connection_details(self.hidden) if self.status is not None else None
        return dataclasses.replace(self, status=status, detail=None)

    @property
    def dag_id(self) -> str:
        return dag_id(self.policy)

    @property
    def backfill(self) -> str | None:
        """The command that runs the missed days, if any."""
        if self.status is None or not self.status.missed:
            return None
        return backfill_command(self.policy, self.status.missed)


def connection_values(dsn: str) -> tuple[str, ...]:
    """The parts of a DSN only a reader of its connection may see in a message: host, user, database."""
    from psycopg2.extensions import parse_dsn

    try:
        parts = parse_dsn(dsn)
    except Exception:  # noqa: BLE001 - nothing to blank in a DSN libpq cannot read
        return ()
    return tuple(str(parts[k]) for k in ("host", "user", "dbname") if parts.get(k))


@contextmanager
def ledger_session(target: Target) -> Iterator[Any]:
    """A read-only psycopg2 connection to the target's database (connect timeout: the command's), whose
    statements give up after :data:`STATEMENT_TIMEOUT`."""
    with connect(target.dsn) as conn:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT set_config('statement_timeout', %(t)s, false),"
                " set_config('default_transaction_read_only', 'on', false)",
                {"t": STATEMENT_TIMEOUT},
            )
        conn.commit()
        yield conn


def failure_text(exc: BaseException) -> str:
    """The first line of an error, as the view shows it (a driver's detail lines stay in the log), with
    anything shaped like a libpq secret (``password=...``, ``sslpassword=...``) blanked."""
    import re

    from airflow_retention.cli.errors import first_line

    return re.sub(r"\b(password|sslpassword)=\S+", r"\1=***", first_line(exc))


def load_panels(
    policies: Sequence[RetentionPolicy],
    *,
    limit: int = RUNS_SHOWN,
    as_of: datetime | None = None,
    dsn: str | None = None,
) -> list[PolicyPanel]:
    """Each policy's panel, in the given order. Policies sharing a database and ledger schema share one
    connection; a database that cannot be reached is tried once and fails each of its policies.

    :param policies: the policies to show.
    :param limit: the runs to read per policy.
    :param as_of: the time missed days are computed at (default: the database's now).
    :param dsn: a DSN for every policy instead of their connections (tests, the command's ``--dsn``).
    """
    panels: dict[str, PolicyPanel] = {}
    groups: dict[Target, list[RetentionPolicy]] = {}
    for policy in policies:
        try:
            groups.setdefault(target_for(policy, dsn), []).append(policy)
        except Exception as exc:  # noqa: BLE001 - an undefined or malformed connection is this policy's problem
            error = f"connection {policy.conn_id!r} cannot be used"
            panels[policy.name] = PolicyPanel(policy, error=error, detail=failure_text(exc))
    for target, group in groups.items():
        try:
            with ledger_session(target) as conn:
                for policy in group:
                    panel = _panel(conn, policy, limit, as_of)
                    panels[policy.name] = dataclasses.replace(panel, hidden=connection_values(target.dsn))
        except Exception as exc:  # noqa: BLE001 - the database is unreachable: say so for each of its policies
            for policy in group:
                error = f"the database of connection {policy.conn_id!r} cannot be reached"
                panels.setdefault(policy.name, PolicyPanel(policy, error=error, detail=failure_text(exc)))
    return [panels[p.name] for p in policies]


def _panel(conn: Any, policy: RetentionPolicy, limit: int, as_of: datetime | None) -> PolicyPanel:
    from airflow_retention.cli.report import policy_status

    try:
        status = policy_status(conn, policy, limit=limit, as_of=as_of)
    except Exception as exc:  # noqa: BLE001 - e.g. no privilege on the ledger schema: the other policies still show
        error = f"ledger schema {policy.ledger_schema!r} of connection {policy.conn_id!r}"
        return PolicyPanel(policy, error=error, detail=failure_text(exc))
    panel = PolicyPanel(policy, status=status, slo=status.slo)
    if status.ledger_version is not None and status.slo is None:
        panel = dataclasses.replace(panel, slo_error="no complete run in the ledger to learn the cleanup SLO from yet")
    try:
        # Holds are judged at the database's now, not at ``as_of`` (the date missed days are counted at).
        now = database_now(conn)
        budget, runs = load_budget(conn, policy, status.ledger_version, status.runs, now, status.budget)
        return dataclasses.replace(panel, budget=budget, run_budgets=runs)
    except Exception as exc:  # noqa: BLE001 - the runs still show without the budget's side of them
        return dataclasses.replace(panel, budget_error=failure_text(exc))


@dataclass(frozen=True)
class ChunkView:
    """One chunk of a run: where it is in the table (its range, one notation everywhere) and how it went."""

    chunk_key: str
    seq: int | None
    range_label: str
    state: str
    outcome: str | None
    rows_planned: int | None
    rows_deleted: int
    rows_matched: int
    batches: int
    attempts: int
    last_batch_at: datetime | None
    completed_at: datetime | None
    last_error: str | None
    # Seconds paused or kept waiting, by reason (``chunks.paused``; empty before ledger version 8).
    paused: dict[str, float] = field(default_factory=dict)


def chunk_view(row: dict[str, Any]) -> ChunkView:
    """A ``Ledger.chunk_rows`` row as the run page shows it."""
    spec = ChunkSpec(
        key=row["chunk_key"],
        lo=row["lo"],
        hi=row["hi"],
        tenants=tuple(row["tenants"]) if row["tenants"] is not None else None,
        seq=row["seq"],
        rows_planned=row["rows_planned"],
        partition=row["partition"],
        partition_oid=row["partition_oid"],
        action=row["action"],
    )
    return ChunkView(
        chunk_key=row["chunk_key"],
        seq=row["seq"],
        range_label=spec.label(),
        state=row["state"],
        outcome=row["outcome"],
        rows_planned=row["rows_planned"],
        rows_deleted=int(row["rows_deleted"]),
        rows_matched=int(row["rows_matched"]),
        batches=int(row["batches"]),
        attempts=int(row["attempts"]),
        last_batch_at=row["last_batch_at"],
        completed_at=row["completed_at"],
        last_error=row["last_error"],
        paused={k: float(v) for k, v in (row.get("paused") or {}).items() if v},
    )


@dataclass(frozen=True)
class RunDetail:
    """One run of a policy with its chunks (totals summed from the chunks)."""

    policy: RetentionPolicy
    summary: RunSummary
    chunks: list[ChunkView]
    # The run's pauses and hold, and the budget's observations over its span (the chart); None before
    # ledger version 8.
    budget: RunBudget | None = None
    points: list[RunPoint] = field(default_factory=list)
    state: BudgetView | None = None
    # Where the run's span ends (verified, now while it runs, else its last batch): the chart's right edge.
    span_end: datetime | None = None


def load_run(policy: RetentionPolicy, run_key: str, *, dsn: str | None = None) -> RunDetail | None:
    """The run ``run_key`` of ``policy`` with its chunks; None when the ledger has no such run of the policy.
    Raises when the database or the ledger cannot be read (the page says so)."""
    ledger = Ledger(policy.ledger_schema)
    with ledger_session(target_for(policy, dsn)) as conn:
        if ledger.version(conn) is None:
            return None
        run = ledger.get_run(conn, run_key)
        if run is None or run["policy"] != policy.name:
            return None
        rows = ledger.chunk_rows(conn, run_key)
        now = database_now(conn)
        summary = summarize_run(run, rows, now)
        version = ledger.version(conn)
        state = ledger.budget_snapshot(conn)
        budget, runs = load_budget(conn, policy, version, [summary], now, state)
        end = span_end(summary, now)
        points = run_points(conn, ledger, summary.planned_at, end) if runs else []
    return RunDetail(policy, summary, [chunk_view(r) for r in rows], runs.get(run_key), points, budget, end)
