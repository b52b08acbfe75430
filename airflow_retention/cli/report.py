"""The status report of a policy (``airflow-retention status`` and the Retention view): its recent runs,
its warnings, the scheduled runs it missed and the ``airflow backfill create`` command that runs them, the
database budget as it stands, the latest run's pauses per reason and the cleanup SLO.

Nothing here writes. :mod:`airflow_retention.cli.render` draws a :class:`PolicyStatus`; ``to_json``
gives the stable ``--json`` form. Runs are summarised by :mod:`airflow_retention.cli.runs`, warnings
found by :mod:`airflow_retention.cli.alerts`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_retention.cli.alerts import (
    Alert,
    dead_letter_warnings,
    deferred_leaves_warning,
    mark_failing,
    plan_failure_alerts,
    run_warnings,
    slo_alerts,
    target_alert,
)
from airflow_retention.cli.runs import RunSummary, load_runs
from airflow_retention.cli.timefmt import human_seconds, iso, short
from airflow_retention.core.policy.model import policy_dag_id
from airflow_retention.core.running.verify import MISSED_RUNS_GRACE

log = logging.getLogger(__name__)


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
    # The database budget as its last observation left it (``Ledger.budget_snapshot``; None: never observed).
    budget: dict[str, Any] | None = None
    # The latest planned run's pauses, by reason (seconds; ``chunks.paused``): throttled, not stuck.
    paused_run_key: str | None = None
    paused: dict[str, float] = field(default_factory=dict)
    # The cleanup SLO (:class:`~airflow_retention.core.running.slo.CleanupSlo`); None: no complete run yet.
    slo: Any | None = None

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
            "budget": budget_json(self.budget, enabled=p.budget.enabled),
            "paused_seconds": {"run_key": self.paused_run_key, "by_reason": dict(self.paused)},
            "slo": self.slo.to_dict() if self.slo is not None else None,
        }


def budget_json(state: dict[str, Any] | None, *, enabled: bool = True) -> dict[str, Any]:
    """The budget's state for ``--json``: ``observed`` false when no purge ever observed it."""
    if state is None:
        return {"enabled": enabled, "observed": False}
    return {
        "enabled": enabled,
        "observed": True,
        "state": budget_text(state),
        "level": state["level"],
        "concurrency": state["concurrency"],
        "duty": state["duty"],
        "paused": state["paused"],
        "reasons": list(state["reasons"]),
        "causes": list(state["causes"]),
        "canary_ms": state["canary_ms"],
        "baseline_ms": state["baseline_ms"],
        "signals": state["signals"],
        "observed_at": iso(state["observed_at"]),
        "age_seconds": state["age_s"],
        "observer": state["observer"],
    }


def budget_text(state: dict[str, Any]) -> str:
    """``2 batch(es) at once, busy 100%``, or ``paused``."""
    if state["paused"]:
        return "paused"
    return f"{state['concurrency']} batch(es) at once, busy {state['duty']:.0%}"


def budget_line(state: dict[str, Any] | None, *, enabled: bool = True) -> str:
    """The budget in one line: its step, why it is there, the canary against its baseline, how old."""
    if state is None:
        return "database budget: never observed" + ("" if enabled else " (off for this policy: budget: false)")
    text = f"database budget: {budget_text(state)} (level {state['level']})"
    if state["reasons"]:
        text += f", {'paused' if state['paused'] else 'held'} by: {'; '.join(state['reasons'])}"
    elif state["causes"]:
        text += f", lowered by: {', '.join(state['causes'])}"
    if state["canary_ms"] is not None and state["baseline_ms"] is not None:
        text += f"; canary {state['canary_ms']:.1f} ms, baseline {state['baseline_ms']:.1f} ms"
    text += f"; observed {human_seconds(state['age_s'])} ago"
    return text + ("" if enabled else "; off for this policy (budget: false)")


def paused_line(run_key: str | None, paused: dict[str, float]) -> str | None:
    """The latest run's pauses by reason, most first, or None when it paused for nothing."""
    if run_key is None or not paused:
        return None
    shown = ", ".join(f"{reason} {human_seconds(seconds, precise=True)}" for reason, seconds in paused.items())
    return f"run {run_key} paused: {shown}"


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
    budget, paused_run, paused, slo = budget_and_slo(conn, ledger, policy, runs)
    warnings = [
        *target,
        *plan_failure_alerts(conn, ledger, policy, runs),
        *missed_warnings(policy, missed),
        *run_warnings(runs, now, held_by=paused_now(budget)),
        *dead_letter_warnings(conn, ledger, runs),
        *deferred_leaves_warning(runs),
        *slo_alerts(slo),
    ]
    return PolicyStatus(
        policy,
        version,
        as_of,
        runs,
        missed,
        mark_failing(warnings, runs, now),
        covered,
        budget=budget,
        paused_run_key=paused_run,
        paused=paused,
        slo=slo,
    )


def paused_now(budget: dict[str, Any] | None) -> str | None:
    """Why the database budget pauses every purge now, or None: not paused, or its last observation is too
    old to hold (no purge is steering by it)."""
    from airflow_retention.core.running.budget import STALE_MIN_S

    if budget is None or not budget["paused"] or budget["age_s"] is None or budget["age_s"] > STALE_MIN_S:
        return None
    return "; ".join(budget["reasons"]) or "a pause signal"


def budget_and_slo(
    conn: Any, ledger: Any, policy: Any, runs: list[RunSummary]
) -> tuple[dict[str, Any] | None, str | None, dict[str, float], Any | None]:
    """The budget's state, the latest planned run (its key) and its pauses by reason, and the cleanup SLO.
    A role not granted the budget's tables (an administrator migrated the ledger) still gets the rest."""
    from airflow_retention.core.errors import PermanentError
    from airflow_retention.core.running.slo import cleanup_slo

    planned = [r for r in runs if r.kind != "lone"]
    latest = max(planned, key=lambda r: r.planned_at, default=None)
    try:
        budget = ledger.budget_snapshot(conn)
        paused = ledger.paused_by_reason(conn, latest.run_key) if latest is not None else {}
        slo = cleanup_slo(conn, policy, ledger)
    except PermanentError as exc:
        if "(SQLSTATE 42501)" not in str(exc):
            raise
        log.warning("no privilege on the budget's tables of the ledger %s: budget and SLO not shown", ledger.schema)
        return None, None, {}, None
    return budget, latest.run_key if latest is not None else None, paused, slo


def database_now(conn: Any) -> datetime:
    from airflow_retention.core.db import dbapi

    return dbapi.fetch_all(conn, "SELECT now()")[0][0]


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
