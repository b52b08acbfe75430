"""The status report of a policy (``airflow-retention status`` and the Retention view): its recent runs,
its warnings, the scheduled runs it missed and the ``airflow backfill create`` command that runs them.

Nothing here writes. :mod:`airflow_retention.cli.render` draws a :class:`PolicyStatus`; ``to_json``
gives the stable ``--json`` form. Runs are summarised by :mod:`airflow_retention.cli.runs`, warnings
found by :mod:`airflow_retention.cli.alerts`.
"""

from __future__ import annotations

import dataclasses
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
    target_alert,
)
from airflow_retention.cli.runs import RunSummary, load_runs
from airflow_retention.cli.timefmt import iso, short
from airflow_retention.core.policy.model import policy_dag_id
from airflow_retention.core.running.verify import MISSED_RUNS_GRACE


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
        *deferred_leaves_warning(runs),
    ]
    return PolicyStatus(policy, version, as_of, runs, missed, mark_failing(warnings, runs, now), covered)


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
