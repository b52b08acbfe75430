"""The cleanup SLO of a policy, learnt from the ledger's history: whether the purge, inside the database
budget, keeps up with the rows that become eligible.

With ``λ`` the rows that become eligible per day, ``μ`` the rows per second of one worker while it works
under the budget, and ``c`` the concurrency the budget allowed (batches at once times their duty cycle),
the purge keeps up when ``c·μ`` over the cleanup window exceeds what arrives in that window plus the
backlog left eligible (``c·μ·W > λ·W + backlog``). ``status``, the verify task's log and the metrics show
it, and warn when it does not hold, and when the budget held the last run at its floor most of the time
("exhausted database budget": the foreground leaves the purge no room; docs/concepts.md, "The database
budget").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.durations import format_window
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.controller import floor_level
from airflow_retention.core.running.verify import CRON_PRESETS

# The complete runs that λ and μ are learnt from, latest cutoff first.
SAMPLE_RUNS = 8
# "Most of a run" at the floor: the exhausted budget's warning.
FLOOR_SHARE_WARNING = 0.5
# The window when the policy has no cleanup_window and no cron schedule: a day, as @daily.
DEFAULT_WINDOW = timedelta(days=1)
DAY_S = 86_400.0


@dataclass(frozen=True)
class CleanupSlo:
    """A policy's cleanup SLO as its history tells it.

    :param lambda_rows_per_day: rows that become eligible per day (rows the recent runs deleted, per day
        of their dates; one run: its rows over one schedule interval).
    :param mu_rows_per_s: rows per second of one worker while it works (its budget's and throttle's pauses
        left out); None when no chunk ran a batch in one attempt.
    :param concurrency: ``c``, the time-weighted mean over the last run of the batches the budget allowed
        at once times their duty cycle (0 while paused); the policy's ``max_duty_cycle`` without observations.
    :param backlog_rows: rows left eligible by the latest run whose cleanup lag was measured.
    :param window_s: the cleanup window: ``cleanup_window``, else the schedule's interval, else a day.
    :param capacity_rows: ``c·μ·window``: rows the purge can delete inside the window (None: μ unknown).
    :param needed_rows: ``λ·window + backlog``: rows it has to.
    :param keeps_up: capacity above need (None: not known).
    :param floor_share: the share of the last run's budget observations at the ladder's floor or paused.
    :param floor_reasons: the signals that held it there, most frequent first, then the reasons its chunks
        paused for (most seconds first).
    :param paused_seconds: the last run's pauses by reason (``chunks.paused`` summed).
    """

    policy: str
    runs: int
    last_run_key: str | None
    lambda_rows_per_day: float
    mu_rows_per_s: float | None
    concurrency: float
    backlog_rows: int
    window_s: float
    capacity_rows: float | None
    needed_rows: float
    keeps_up: bool | None
    floor_share: float
    observations: int = 0
    floor_reasons: tuple[str, ...] = ()
    paused_seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: ``cleanup SLO: λ … rows/day, μ … rows/s per worker, c …, backlog …; …``."""
        mu = f"{self.mu_rows_per_s:,.1f} rows/s per worker" if self.mu_rows_per_s is not None else "unknown"
        head = (
            f"cleanup SLO: λ {self.lambda_rows_per_day:,.0f} rows/day, μ {mu}, c {self.concurrency:.2f},"
            f" backlog {self.backlog_rows:,} row(s), window {_window(self.window_s)}"
        )
        if self.capacity_rows is None:
            verdict = "capacity unknown (no chunk worked in one attempt)"
        else:
            verdict = f"capacity {self.capacity_rows:,.0f} row(s) for {self.needed_rows:,.0f} needed"
        if self.keeps_up is not None:
            verdict += ": keeps up" if self.keeps_up else ": at risk"
        floor = f"; at the budget's floor {self.floor_share:.0%} of the last run" if self.observations else ""
        return f"{head}; {verdict}{floor} (from {self.runs} run(s))"

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "runs": self.runs,
            "last_run_key": self.last_run_key,
            "lambda_rows_per_day": round(self.lambda_rows_per_day, 3),
            "mu_rows_per_s": round(self.mu_rows_per_s, 3) if self.mu_rows_per_s is not None else None,
            "concurrency": round(self.concurrency, 3),
            "backlog_rows": self.backlog_rows,
            "window_s": self.window_s,
            "capacity_rows": round(self.capacity_rows, 1) if self.capacity_rows is not None else None,
            "needed_rows": round(self.needed_rows, 1),
            "keeps_up": self.keeps_up,
            "floor_share": round(self.floor_share, 3),
            "observations": self.observations,
            "floor_reasons": list(self.floor_reasons),
            "paused_seconds": dict(self.paused_seconds),
            "warnings": list(self.warnings),
        }


def cleanup_slo(conn: Any, policy: RetentionPolicy, ledger: Ledger | None = None) -> CleanupSlo | None:
    """The policy's cleanup SLO from its ledger's history (reads only); None when the ledger holds no
    complete run of the policy (of its mode) to learn from."""
    ledger = ledger or Ledger(policy.ledger_schema)
    if ledger.version(conn) is None:
        return None
    sample = ledger.slo_runs(conn, policy.name, dry_run=policy.dry_run, limit=SAMPLE_RUNS)
    if not sample:
        return None
    interval = schedule_interval(policy.schedule)
    window = policy.cleanup_window or interval or DEFAULT_WINDOW
    window_s = window.total_seconds()
    arrivals = lambda_per_day(sample, interval or DEFAULT_WINDOW)
    rows, worked_s = ledger.work_of(conn, [run.run_key for run in sample])
    mu = rows / worked_s if worked_s > 0 and rows > 0 else None
    backlog = next((run.eligible_left for run in sample if run.eligible_left is not None), 0) or 0

    last = ledger.last_worked_run(conn, policy.name, dry_run=policy.dry_run)
    concurrency, floor_share, observations, reasons, paused = policy.max_duty_cycle, 0.0, 0, (), {}
    if last is not None:
        run_key, since, until = last
        share = ledger.budget_share(
            conn, since, until, floor_level=floor_level(policy.budget), max_duty=policy.max_duty_cycle
        )
        if share.mean_share is not None:
            concurrency = share.mean_share
        observations = share.observations
        floor_share = share.at_floor / share.observations if share.observations else 0.0
        paused = ledger.paused_by_reason(conn, run_key)
        reasons = tuple(dict.fromkeys([*share.floor_reasons, *paused]))

    capacity = concurrency * mu * window_s if mu is not None else None
    needed = arrivals * window_s / DAY_S + backlog
    keeps_up = True if needed <= 0 else (capacity > needed if capacity is not None else None)
    warnings = []
    if keeps_up is False:
        rate = concurrency * (mu or 0.0)
        warnings.append(
            f"cleanup SLO at risk: c*mu = {rate:,.1f} rows/s cannot keep up with lambda {arrivals:,.0f} rows/day"
            f" plus a backlog of {backlog:,} row(s) within the cleanup window {_window(window_s)}"
            f" (c {concurrency:.2f} x mu {mu or 0.0:,.1f} rows/s per worker: {capacity or 0.0:,.0f} row(s) in the"
            f" window, {needed:,.0f} needed)"
        )
    if floor_share > FLOOR_SHARE_WARNING:
        why = ", ".join(
            f"{r} ({paused[r]:,.0f} s paused)" if paused.get(r) else r for r in reasons if r != "max_duty_cycle"
        )
        warnings.append(
            f"exhausted database budget: held at its floor for {floor_share:.0%} of the last run"
            f" (reasons: {why or 'not recorded'}); the foreground leaves the purge no room: see docs/concepts.md,"
            " 'The database budget'"
        )
    return CleanupSlo(
        policy=policy.name,
        runs=len(sample),
        last_run_key=last[0] if last is not None else None,
        lambda_rows_per_day=arrivals,
        mu_rows_per_s=mu,
        concurrency=concurrency,
        backlog_rows=int(backlog),
        window_s=window_s,
        capacity_rows=capacity,
        needed_rows=needed,
        keeps_up=keeps_up,
        floor_share=floor_share,
        observations=observations,
        floor_reasons=reasons,
        paused_seconds=paused,
        warnings=warnings,
    )


def lambda_per_day(sample: list[Any], interval: timedelta) -> float:
    """Rows that become eligible per day, from runs latest first: each run deletes what became eligible
    since the run before, so the rows of every run but the oldest over the days between the oldest and the
    latest run's dates (their cutoffs when a run has no date recorded). Runs that share a date (a month's
    retention gives 03-28 to 03-31 one cutoff), or a single run: their rows over one interval each."""
    dated = all(run.run_date is not None for run in sample)
    dates = [run.run_date if dated else run.cutoff for run in sample]
    span_days = (dates[0] - dates[-1]).total_seconds() / DAY_S
    if len(sample) >= 2 and span_days > 0:
        return sum(run.rows for run in sample[:-1]) / span_days
    interval_days = interval.total_seconds() / DAY_S
    return sum(run.rows for run in sample) / (len(sample) * interval_days)


def schedule_interval(schedule: str | None) -> timedelta | None:
    """The interval between two runs of a cron schedule (or preset); None for a schedule without one."""
    expression = CRON_PRESETS.get(schedule or "", schedule or "")
    if not expression or expression.startswith("@"):
        return None
    from croniter import croniter

    it = croniter(expression, datetime(2024, 1, 1, tzinfo=timezone.utc).replace(tzinfo=None))
    first = it.get_next(datetime)
    return it.get_next(datetime) - first


def _window(seconds: float) -> str:
    return format_window(timedelta(seconds=seconds))
