"""The warnings of a policy, read from the ledger and the target table: the target check, a failed plan,
stuck or unverified runs, chunk errors and dead letters, and which of them make the policy failing
(``status`` exits 3). The missed scheduled runs' warning is built with the rest of the status in
:mod:`airflow_retention.cli.report`.

Nothing here writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds, short

# A planned run with no committed batch for this long is reported stuck.
STUCK_AFTER = timedelta(hours=1)


@dataclass(frozen=True)
class Alert:
    """One line of the warnings of a policy; ``kind`` is ``target`` (the table or a column the policy
    names is missing or wrong: the next plan fails), ``plan_failed`` (the last plan raised, and none
    succeeded since), ``missed_run``, ``stuck``, ``throttled`` (no batch for an hour while the database
    budget pauses every purge: held on purpose, not stuck), ``not_verified``,
    ``chunk_error``, ``dead_letter``, ``leaves_deferred`` (the latest run's plan left leaves of a
    partitioned table past the chunk budget), ``slo_at_risk`` (the purge, inside the database budget,
    cannot keep up with the rows that become eligible plus the backlog within the cleanup window),
    ``budget_exhausted`` (the budget held the last run at its floor most of the time) or ``no_ledger``.
    ``public`` is the message without connection
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
# run has stopped on an error. Missed days, a missing ledger and the SLO's warnings are not failures: the
# purge still runs, slower than it should.
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


def run_warnings(runs: list[RunSummary], now: datetime, held_by: str | None = None) -> list[Alert]:
    """Runs stuck planned (no batch for an hour), runs whose chunks are done but not verified, chunk errors.

    :param held_by: why the database budget pauses every purge now (None: it does not): a run without a
        batch for an hour is then ``throttled`` on purpose (a warning), not ``stuck`` (a failure).
    """
    out: list[Alert] = []
    for run in runs:
        if run.kind == "lone" or run.state == "complete":
            pass
        elif run.running:
            idle = now - (run.last_batch_at or run.planned_at)
            if idle > STUCK_AFTER and held_by is not None:
                out.append(
                    Alert(
                        "throttled",
                        f"run {run.run_key}: no batch for {human_seconds(idle.total_seconds())}: held on purpose,"
                        f" the database budget is paused ({held_by})",
                        run.run_key,
                    )
                )
            elif idle > STUCK_AFTER:
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


def deferred_leaves_warning(runs: list[RunSummary]) -> list[Alert]:
    """The leaves of a partitioned table the latest planned run left out past the chunk budget: not a
    failure (later runs plan them first), but the table is purged over several runs, not each night."""
    from airflow_retention.core.running.verify import not_covered

    planned = [r for r in runs if r.kind != "lone"]
    latest = max(planned, key=lambda r: r.planned_at, default=None)
    if latest is None or not latest.leaves_deferred:
        return []
    message = (
        f"run {latest.run_key}: {not_covered(latest.leaves_deferred, latest.chunks_expected)}; to purge every"
        " leaf each run, raise [core] max_map_length"
    )
    return [Alert("leaves_deferred", message, latest.run_key)]


# The SLO's warnings by how they begin (core/running/slo.py).
SLO_KINDS = {"cleanup SLO at risk": "slo_at_risk", "exhausted database budget": "budget_exhausted"}


def slo_alerts(slo: Any | None) -> list[Alert]:
    """The cleanup SLO's warnings (:func:`~airflow_retention.core.running.slo.cleanup_slo`): at risk, and an
    exhausted database budget. Warnings, never failures: the purge runs, only not fast enough."""
    if slo is None:
        return []
    return [
        Alert(next((k for p, k in SLO_KINDS.items() if w.startswith(p)), "slo_at_risk"), w, slo.last_run_key)
        for w in slo.warnings
    ]
