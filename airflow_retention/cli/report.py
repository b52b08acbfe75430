"""What the command reports, read from the ledger through the public :class:`Ledger` API: run summaries
with their progress, and the warnings of a policy (missed scheduled runs, stuck runs, chunk errors).

Nothing here writes. The values are plain dataclasses; :mod:`airflow_retention.cli.render` draws them and
``to_json`` methods give the stable ``--json`` form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from airflow_retention.cli.timefmt import human_seconds, iso, short
from airflow_retention.core.policy.model import policy_dag_id
from airflow_retention.core.running.verify import MISSED_RUNS_GRACE

# A planned run with no committed batch for this long is reported stuck.
STUCK_AFTER = timedelta(hours=1)


def run_kind(run_key: str) -> str:
    """``lone`` (chunks purged without a planner), ``dry-run`` or ``planned``."""
    if run_key.endswith("#lone"):
        return "lone"
    if run_key.endswith("#dry-run"):
        return "dry-run"
    return "planned"


@dataclass(frozen=True)
class ChunkProblem:
    chunk_key: str
    state: str
    last_error: str | None
    last_batch_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "chunk_key": self.chunk_key,
            "state": self.state,
            "last_error": self.last_error,
            "last_batch_at": iso(self.last_batch_at),
        }


@dataclass(frozen=True)
class RunSummary:
    """One ledger run with its progress: totals from the run row once verified, else from its chunks."""

    run_key: str
    kind: str
    cutoff: datetime
    state: str
    chunks_expected: int
    chunks_complete: int
    rows_planned: int
    rows_deleted: int
    rows_matched: int
    rows_archived: int
    planned_at: datetime
    completed_at: datetime | None
    last_batch_at: datetime | None
    duration_seconds: float | None
    cleanup_lag_seconds: float | None
    eligible_left: int | None
    oldest_eligible_at: datetime | None
    chunk_problems: tuple[ChunkProblem, ...] = ()

    @property
    def chunks_done(self) -> bool:
        return self.chunks_complete >= self.chunks_expected

    @property
    def running(self) -> bool:
        """Planned and not every chunk complete yet (a lone run never is verified: it runs while a chunk is
        incomplete)."""
        return self.state != "complete" and not self.chunks_done

    @property
    def status(self) -> str:
        """The state in words: complete, running, or chunks done but not verified yet."""
        if self.state == "complete":
            return "complete"
        if self.kind == "lone":
            return "lone, chunks complete" if self.chunks_done else "lone, running"
        return "planned, chunks complete, not verified" if self.chunks_done else "planned"

    def duration_text(self) -> str:
        if self.duration_seconds is None:
            return "—"
        text = human_seconds(self.duration_seconds, precise=True)
        return f"running for {text}" if self.running else text

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "kind": self.kind,
            "cutoff": iso(self.cutoff),
            "state": self.state,
            "status": self.status,
            "running": self.running,
            "chunks_expected": self.chunks_expected,
            "chunks_complete": self.chunks_complete,
            "rows_planned": self.rows_planned,
            "rows_deleted": self.rows_deleted,
            "rows_matched": self.rows_matched,
            "rows_archived": self.rows_archived,
            "planned_at": iso(self.planned_at),
            "completed_at": iso(self.completed_at),
            "last_batch_at": iso(self.last_batch_at),
            "duration_seconds": self.duration_seconds,
            "cleanup_lag_seconds": self.cleanup_lag_seconds,
            "eligible_left": self.eligible_left,
            "oldest_eligible_at": iso(self.oldest_eligible_at),
            "chunk_errors": [p.to_json() for p in self.chunk_problems if p.last_error],
        }


def summarize_run(run: dict[str, Any], chunks: list[dict[str, Any]] | None, now: datetime) -> RunSummary:
    """A run row (``Ledger.get_run``/``recent_runs``) and, for a run not verified yet, its chunk rows."""
    kind = run_kind(run["run_key"])
    verified = run["state"] == "complete" and chunks is None
    if verified:
        complete, deleted = run["chunks_completed"] or 0, run["rows_deleted"] or 0
        matched, archived = run["rows_matched"] or 0, run["rows_archived"] or 0
        last_batch = run["completed_at"]
    else:
        rows = chunks or []
        complete = sum(1 for c in rows if c["state"] == "complete")
        deleted = sum(c["rows_deleted"] for c in rows)
        matched = sum(c["rows_matched"] for c in rows)
        archived = sum(c["rows_archived"] for c in rows)
        last_batch = max((c["last_batch_at"] for c in rows if c["last_batch_at"]), default=None)
    expected = run["chunks_expected"] if kind != "lone" else len(chunks or [])
    rows_planned = run["rows_planned"] if kind != "lone" else sum(c["rows_planned"] or 0 for c in chunks or [])
    return RunSummary(
        run_key=run["run_key"],
        kind=kind,
        cutoff=run["cutoff"],
        state=run["state"],
        chunks_expected=int(expected),
        chunks_complete=int(complete),
        rows_planned=int(rows_planned),
        rows_deleted=int(deleted),
        rows_matched=int(matched),
        rows_archived=int(archived),
        planned_at=run["planned_at"],
        completed_at=run["completed_at"],
        last_batch_at=last_batch,
        duration_seconds=_duration(run, chunks, now),
        cleanup_lag_seconds=run["cleanup_lag_seconds"],
        eligible_left=run["eligible_left"],
        oldest_eligible_at=run["oldest_eligible_at"],
        chunk_problems=tuple(_problems(chunks or [])),
    )


def _duration(run: dict[str, Any], chunks: list[dict[str, Any]] | None, now: datetime) -> float | None:
    """Planned to verified; for a run not verified, planned to its last completed chunk when every chunk
    is complete, else planned to now (running for ...)."""
    if run["completed_at"] is not None:
        return (run["completed_at"] - run["planned_at"]).total_seconds()
    rows = chunks or []
    if rows and all(c["state"] == "complete" for c in rows) and len(rows) >= run["chunks_expected"]:
        return (max(c["completed_at"] for c in rows) - run["planned_at"]).total_seconds()
    return (now - run["planned_at"]).total_seconds()


def _problems(chunks: list[dict[str, Any]]) -> list[ChunkProblem]:
    return [
        ChunkProblem(c["chunk_key"], c["state"], c["last_error"], c["last_batch_at"])
        for c in chunks
        if c["state"] != "complete"
    ]


def load_runs(conn: Any, ledger: Any, policy_name: str, limit: int, now: datetime) -> list[RunSummary]:
    """The policy's last ``limit`` runs, newest cutoff first. Chunk rows are read only for runs not
    verified yet (one query each)."""
    runs = ledger.recent_runs(conn, policy_name, limit=limit)
    runs.sort(key=lambda r: (r["cutoff"], r["planned_at"]), reverse=True)
    return [
        summarize_run(run, ledger.chunk_rows(conn, run["run_key"]) if run["state"] != "complete" else None, now)
        for run in runs
    ]


def database_now(conn: Any) -> datetime:
    from airflow_retention.core.db import dbapi

    return dbapi.fetch_all(conn, "SELECT now()")[0][0]


@dataclass(frozen=True)
class Alert:
    """One line of the warnings of a policy; ``kind`` is ``target`` (the table or a column the policy
    names is missing or wrong: the next plan fails), ``plan_failed`` (the last plan raised, and none
    succeeded since), ``missed_run``, ``stuck``, ``not_verified``,
    ``chunk_error``, ``dead_letter`` or ``no_ledger``. ``public`` is the message without connection
    details (the database's name), for readers who may not see the connection; None: the same."""

    kind: str
    message: str
    run_key: str | None = None
    public: str | None = None
    # Whether it makes the policy failing (status exits 3): see :func:`mark_failing`.
    failing: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_key": self.run_key, "message": self.message}

    def without_connection_details(self, hidden: Sequence[str] = ()) -> Alert:
        """The alert for a reader who may not see the connection: its ``public`` text, and every value of
        ``hidden`` (the connection's host, user, database) blanked wherever a message quotes it (a
        privilege error names the role, a plan's error the database)."""
        return dataclasses.replace(self, message=blank(self.public or self.message, hidden), public=None)


def blank(text: str, hidden: Sequence[str]) -> str:
    """``text`` with each value of ``hidden`` that stands as a word replaced by ``…``."""
    import re

    for value in sorted({v for v in hidden if v}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(value)}(?![\w.-])", "…", text)
    return text


# Warnings that mean a policy is failing (``status`` exits 3): its target cannot be purged, or its latest
# run has stopped on an error. Missed days and a missing ledger are not failures.
FAILING_KINDS = frozenset({"stuck", "not_verified", "dead_letter"})
# Failing whatever the latest run: the target check, and a failed plan no plan has succeeded since.
ALWAYS_FAILING = frozenset({"target", "plan_failed"})
# A chunk error of the latest run makes it failing once the run has committed no batch for this long:
# longer than the longest retry delay (it doubles up to 10 minutes), so a retry still to come is not a
# failure, while a chunk that failed for good shows well before the run counts as stuck.
CHUNK_ERROR_FAILING_AFTER = timedelta(minutes=15)


def mark_failing(warnings: list[Alert], runs: list[RunSummary], now: datetime) -> list[Alert]:
    """The warnings, those that make the policy failing marked: the target check, a failed plan, and the
    latest run (planned last; lone runs left out) stuck, not verified, with dead letters, or with a chunk
    error and no batch for :data:`CHUNK_ERROR_FAILING_AFTER`."""
    planned = [r for r in runs if r.kind != "lone"]
    latest = max(planned, key=lambda r: r.planned_at, default=None)
    idle = now - (latest.last_batch_at or latest.planned_at) if latest is not None else timedelta(0)

    def failing(w: Alert) -> bool:
        if w.kind in ALWAYS_FAILING:
            return True
        if latest is None or w.run_key != latest.run_key:
            return False
        return w.kind in FAILING_KINDS or (w.kind == "chunk_error" and idle > CHUNK_ERROR_FAILING_AFTER)

    return [dataclasses.replace(w, failing=failing(w)) for w in warnings]


def target_alert(conn: Any, policy: Any, *, privileges: bool = True) -> Alert | None:
    """The planner's own checks of the table, its columns and types, read only: what would fail the next
    plan at once (a connection pointed at a database without the table, a renamed column), or None (also
    when the check could not finish: a lock or statement timeout is no verdict).

    :param privileges: also check the purge role's privileges on the table (only meaningful through the
        policy's own connection, not another role's ``--dsn``)."""
    from airflow_retention.core.db.catalog import inspect_target
    from airflow_retention.core.errors import PermanentError, RetryableError, TableMissing

    try:
        inspect_target(conn, policy, quiet=True, privileges=privileges)
    except TableMissing as exc:
        return Alert("target", f"the next plan fails: {exc}", public=f"the next plan fails: {exc.without_database()}")
    except PermanentError as exc:
        return Alert("target", f"the next plan fails: {exc}")
    except RetryableError:
        return None
    return None


@dataclass(frozen=True)
class MissedRunInfo:
    anchor: datetime
    cutoff: datetime
    run_key: str
    in_ledger: bool
    # The cutoff of the later complete run that already deleted what this date's run would; None: a
    # backfill of this date could still delete rows.
    covered_by: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "date": iso(self.anchor),
            "cutoff": iso(self.cutoff),
            "run_key": self.run_key,
            "in_ledger": self.in_ledger,
            "covered_by_cutoff": iso(self.covered_by),
        }


@dataclass(frozen=True)
class PolicyStatus:
    policy: Any
    ledger_version: int | None
    as_of: datetime
    runs: list[RunSummary] = field(default_factory=list)
    missed: list[MissedRunInfo] = field(default_factory=list)
    warnings: list[Alert] = field(default_factory=list)
    # Scheduled dates without a run of their own that a later complete run covered (no backfill needed).
    covered: list[MissedRunInfo] = field(default_factory=list)

    @property
    def failures(self) -> list[Alert]:
        """The warnings that make the policy failing (:func:`mark_failing`)."""
        return [w for w in self.warnings if w.failing]

    def without_connection_details(self, hidden: Sequence[str] = ()) -> PolicyStatus:
        return dataclasses.replace(self, warnings=[w.without_connection_details(hidden) for w in self.warnings])

    def to_json(self) -> dict[str, Any]:
        p = self.policy
        return {
            "policy": p.name,
            "table": str(p.table),
            "retention": str(p.retention),
            "schedule": p.schedule,
            "dry_run": p.dry_run,
            "ledger_schema": p.ledger_schema,
            "ledger_version": self.ledger_version,
            "as_of": iso(self.as_of),
            "runs": [r.to_json() for r in self.runs],
            "missed_runs": [m.to_json() for m in self.missed],
            "covered_runs": [m.to_json() for m in self.covered],
            "warnings": [w.to_json() for w in self.warnings],
            "failing": [w.to_json() for w in self.failures],
        }


def policy_status(
    conn: Any, policy: Any, *, limit: int, as_of: datetime | None = None, privileges: bool = True
) -> PolicyStatus:
    """Runs, missed scheduled runs and warnings of one policy, as of ``as_of`` (default: database now).

    :param privileges: check the purge role's privileges on the table too (the connection is the policy's)."""
    from airflow_retention.core.ledger.ledger import Ledger

    ledger = Ledger(policy.ledger_schema)
    now = database_now(conn)
    as_of = as_of or now
    target = [a for a in [target_alert(conn, policy, privileges=privileges)] if a is not None]
    version = ledger.version(conn)
    if version is None:
        warning = Alert(
            "no_ledger", f"no ledger in schema {policy.ledger_schema!r} yet: no run of any policy was planned there"
        )
        return PolicyStatus(policy, None, as_of, warnings=mark_failing([*target, warning], [], now))
    runs = load_runs(conn, ledger, policy.name, limit, now)
    missed, covered = find_missed(conn, ledger, policy, as_of)
    warnings = [
        *target,
        *plan_failure_alerts(conn, ledger, policy, runs),
        *missed_warnings(policy, missed),
        *run_warnings(runs, now),
        *dead_letter_warnings(conn, ledger, runs),
    ]
    return PolicyStatus(policy, version, as_of, runs, missed, mark_failing(warnings, runs, now), covered)


def plan_failure_alerts(conn: Any, ledger: Any, policy: Any, runs: list[RunSummary]) -> list[Alert]:
    """The policy's last failed plan, unless a plan succeeded since (that run is in the ledger, or a run
    was planned after the failure)."""
    failure = ledger.latest_plan_failure(conn, policy.name)
    if failure is None or ledger.get_run(conn, failure["run_key"]) is not None:
        return []
    if any(run.planned_at > failure["failed_at"] for run in runs if run.kind != "lone"):
        return []
    tries = f", {failure['attempts']} attempts" if failure["attempts"] > 1 else ""
    message = (
        f"run {failure['run_key']}: its plan failed at {short(failure['failed_at'])}{tries}: {failure['error']}"
        " (clear the plan task once fixed)"
    )
    return [Alert("plan_failed", message, failure["run_key"])]


def dead_letter_warnings(conn: Any, ledger: Any, runs: list[RunSummary]) -> list[Alert]:
    """Tenants a one-pass chunk could not purge and left (open dead letters), per run."""
    from airflow_retention.core.db import dbapi

    if ledger.version(conn) < 4:
        return []
    out = []
    for run in runs:
        with dbapi.transaction(conn) as cur:
            letters = ledger.open_dead_letters(cur, run.run_key)
        if letters:
            shown = "; ".join(
                f"tenant {d['tenant']} of {d['chunk_key']}: {d['failure_class']} ({d['attempts']} attempt(s))"
                for d in letters[:5]
            )
            out.append(
                Alert(
                    "dead_letter",
                    f"run {run.run_key}: {len(letters)} tenant(s) left by their chunk (dead letters): {shown};"
                    " fix the cause, then clear the chunk task (docs/runbook.md)",
                    run.run_key,
                )
            )
    return out


def find_missed(
    conn: Any, ledger: Any, policy: Any, as_of: datetime
) -> tuple[list[MissedRunInfo], list[MissedRunInfo]]:
    """The scheduled dates of the window before ``as_of`` minus the grace hour (their run may be starting)
    without a complete run (:func:`~airflow_retention.core.running.verify.missed_days`, as the verify task counts
    them): those a backfill could still delete rows for, and those a later complete run covered."""
    from airflow_retention.core.running.verify import missed_days

    days = missed_days(conn, ledger, policy, as_of - MISSED_RUNS_GRACE)

    def info(m: Any) -> MissedRunInfo:
        return MissedRunInfo(m.anchor, m.cutoff, m.run_key, ledger.get_run(conn, m.run_key) is not None, m.covered_by)

    return [info(m) for m in days.missed], [info(m) for m in days.covered]


def missed_warnings(policy: Any, missed: list[MissedRunInfo], shown: int = 5) -> list[Alert]:
    if not missed:
        return []
    never = [m for m in missed if not m.in_ledger]
    dates = ", ".join(f"{m.anchor:%Y-%m-%d}" for m in missed[-shown:]) + (
        f" (the {shown} latest)" if len(missed) > shown else ""
    )
    message = (
        f"{len(missed)} scheduled run(s) without a complete run in the ledger that could still delete rows"
        f" ({len(never)} never planned): "
        f"{dates}; backfill: {backfill_command(policy, missed)}"
    )
    return [Alert("missed_run", message)]


def covered_line(covered: list[MissedRunInfo]) -> str | None:
    """The one line on the scheduled days a later complete run covered (no backfill needed), or None."""
    if not covered:
        return None
    cover = max(m.covered_by for m in covered if m.covered_by is not None)
    return (
        f"{len(covered)} scheduled day(s) from {covered[0].anchor:%Y-%m-%d} to {covered[-1].anchor:%Y-%m-%d} have"
        f" no complete run of their own, but the complete run with cutoff {short(cover)} already deleted what"
        " they would: nothing to backfill"
    )


def backfill_command(policy: Any, missed: list[MissedRunInfo]) -> str:
    """The ``airflow backfill create`` command that runs every missed date (first to last) of the policy."""
    first, last = missed[0].anchor, missed[-1].anchor
    return (
        f"airflow backfill create --dag-id {policy_dag_id(policy)}"
        f" --from-date {first:%Y-%m-%dT%H:%M:%SZ} --to-date {last:%Y-%m-%dT%H:%M:%SZ}"
    )


def run_warnings(runs: list[RunSummary], now: datetime) -> list[Alert]:
    """Runs stuck planned (no batch for an hour), runs whose chunks are done but not verified, chunk errors."""
    out: list[Alert] = []
    for run in runs:
        if run.kind == "lone" or run.state == "complete":
            pass
        elif run.running:
            idle = now - (run.last_batch_at or run.planned_at)
            if idle > STUCK_AFTER:
                since = "no batch committed" if run.last_batch_at is None else "no batch"
                out.append(
                    Alert(
                        "stuck",
                        f"run {run.run_key}: planned {human_seconds((now - run.planned_at).total_seconds())} ago,"
                        f" {run.chunks_complete}/{run.chunks_expected} chunk(s) complete, {since} for"
                        f" {human_seconds(idle.total_seconds())}: stuck? clear its chunk tasks (docs/runbook.md)",
                        run.run_key,
                    )
                )
        elif now - (run.last_batch_at or run.planned_at) > STUCK_AFTER:
            out.append(
                Alert(
                    "not_verified",
                    f"run {run.run_key}: every chunk complete since {short(run.last_batch_at)}, but the run"
                    " was never verified: run (or clear) its verify task",
                    run.run_key,
                )
            )
        for problem in run.chunk_problems:
            if problem.last_error:
                out.append(
                    Alert(
                        "chunk_error",
                        f"run {run.run_key}: chunk {problem.chunk_key} ({problem.state}): {problem.last_error}",
                        run.run_key,
                    )
                )
    return out


@dataclass(frozen=True)
class Progress:
    """How far a run's purge is: chunks complete of expected, rows done (deleted, or matched in a dry run)
    of rows planned."""

    run_key: str
    state: str
    chunks_expected: int
    chunks_complete: int
    chunks_running: int
    rows_planned: int
    rows_done: int
    errors: tuple[ChunkProblem, ...] = ()

    @property
    def done(self) -> bool:
        return self.state == "complete" or self.chunks_complete >= self.chunks_expected

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "state": self.state,
            "done": self.done,
            "chunks_expected": self.chunks_expected,
            "chunks_complete": self.chunks_complete,
            "chunks_running": self.chunks_running,
            "rows_planned": self.rows_planned,
            "rows_done": self.rows_done,
            "chunk_errors": [e.to_json() for e in self.errors],
        }


def progress_of(run: dict[str, Any], chunks: list[dict[str, Any]]) -> Progress:
    """Progress from a run row and its chunk rows (pure: testable without a database)."""
    dry = run["run_key"].endswith("#dry-run")
    lone = run["run_key"].endswith("#lone")
    return Progress(
        run_key=run["run_key"],
        state=run["state"],
        chunks_expected=len(chunks) if lone else int(run["chunks_expected"]),
        chunks_complete=sum(1 for c in chunks if c["state"] == "complete"),
        chunks_running=sum(1 for c in chunks if c["state"] == "running"),
        rows_planned=sum(int(c["rows_planned"] or 0) for c in chunks) if lone else int(run["rows_planned"]),
        rows_done=sum(int(c["rows_matched"] if dry else c["rows_deleted"]) for c in chunks),
        errors=tuple(p for p in _problems(chunks) if p.last_error),
    )


def run_progress(conn: Any, ledger: Any, run_key: str) -> Progress | None:
    run = ledger.get_run(conn, run_key)
    if run is None:
        return None
    return progress_of(run, ledger.chunk_rows(conn, run_key))


def running_run_keys(conn: Any, ledger: Any, policy_name: str, limit: int = 20) -> list[str]:
    """The policy's recent planned runs whose chunks are not all complete (lone runs left out)."""
    keys = []
    for run in ledger.recent_runs(conn, policy_name, limit=limit):
        if run["state"] == "complete" or run_kind(run["run_key"]) == "lone":
            continue
        progress = progress_of(run, ledger.chunk_rows(conn, run["run_key"]))
        if not progress.done:
            keys.append(run["run_key"])
    return keys
