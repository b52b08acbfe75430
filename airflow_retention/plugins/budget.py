"""What the Retention view shows of the database budget (docs/concepts.md, "The database budget"), read from
the policy's ledger: the budget's state now (``budget_state``), each run's time paused per reason (the sum
of its chunks' ``paused``), whether a run without batches is held on purpose (throttled) or stuck, and the
pressure the budget observed during each run (``budget_observations``), for the chart beside cleanup lag.

Only reads: the view's sessions are read-only. A ledger older than version 8 has no budget tables: nothing
of this is shown for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_retention.cli.alerts import STUCK_AFTER
from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds
from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.budget import SCOPE
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.slo import at_floor_sql
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.budget import STALE_MIN_S, STALE_PERIODS
from airflow_retention.core.running.controller import floor_level

# The ledger version that brought the budget tables (core/ledger/schema.py).
BUDGET_LEDGER_VERSION = 8
# Points of a run page's chart: a long run's observations (one per period) are averaged into this many.
RUN_CHART_BUCKETS = 240
THROTTLED, STUCK = "throttled", "stuck"


def has_budget_tables(version: int | None) -> bool:
    return version is not None and version >= BUDGET_LEDGER_VERSION


def _seconds(value: float) -> str:
    """Pauses of a quick run are fractions of a second: two significant digits below 10 s."""
    return f"{value:.2g} s" if value < 10 else human_seconds(value)


@dataclass(frozen=True)
class BudgetView:
    """The database budget as the last observation left it (one row per ledger schema, shared by every
    purge on the database that keeps its ledger there).

    :param live: observed recently enough that a purge is steering by it now; an older state is only
        what the last purge left.
    """

    enabled: bool
    paused: bool
    concurrency: int
    duty: float
    level: int
    max_workers: int
    reasons: tuple[str, ...]
    causes: tuple[str, ...]
    canary_ms: float | None
    baseline_ms: float | None
    observed_at: datetime | None
    age_s: float | None
    live: bool
    floor_level: int  # the policy's floor (``min_duty``) on the ladder

    @property
    def at_floor(self) -> bool:
        """Held at the policy's floor (one batch at a time, busy ``min_duty`` of the time) or below, or paused."""
        return self.paused or self.level <= self.floor_level

    def describe(self) -> str:
        """``paused`` or ``2 batch(es) at once, busy 100%``."""
        if self.paused:
            return "paused"
        return f"{self.concurrency} batch(es) at once, busy {self.duty:.0%}"

    def canary_text(self) -> str:
        if self.canary_ms is None:
            return "canary not measured"
        base = "" if self.baseline_ms is None else f" (baseline {self.baseline_ms:.1f} ms)"
        return f"canary {self.canary_ms:.1f} ms{base}"


def budget_view(state: Mapping[str, Any] | None, policy: RetentionPolicy) -> BudgetView | None:
    """The budget's state as ``status`` reads it (``Ledger.budget_snapshot``), for the view; None when no
    purge has observed it yet."""
    if state is None:
        return None
    settings = policy.budget
    # As the engine judges a state nobody observes (core/running/budget.py): older than this, the
    # purges that steered by it have ended.
    fresh_s = max(STALE_MIN_S, STALE_PERIODS * settings.period_ms / 1000)
    age = state.get("age_s")
    return BudgetView(
        enabled=settings.enabled,
        paused=bool(state["paused"]),
        concurrency=int(state["concurrency"]),
        duty=float(state["duty"]),
        level=int(state["level"]),
        max_workers=settings.max_workers,
        reasons=tuple(state.get("reasons") or ()),
        causes=tuple(state.get("causes") or ()),
        canary_ms=state.get("canary_ms"),
        baseline_ms=state.get("baseline_ms"),
        observed_at=state.get("observed_at"),
        age_s=age,
        live=age is not None and age <= fresh_s,
        floor_level=floor_level(settings),
    )


@dataclass(frozen=True)
class RunPressure:
    """What the budget observed during one run (planned to verified, or to now): its share of the
    database and the foreground's canary against its baseline."""

    observations: int
    paused_share: float
    floor_share: float
    # Batch slots allowed times their duty cycle, averaged over the run (0 while paused).
    allowed_mean: float
    allowed_max: float
    canary_ratio_p90: float | None
    canary_ms_median: float | None
    baseline_ms: float | None

    def text(self) -> str:
        ratio = "" if self.canary_ratio_p90 is None else f", canary p90 {self.canary_ratio_p90:.2f}x baseline"
        paused = f", paused {self.paused_share:.0%} of it" if self.paused_share else ""
        return f"allowed {self.allowed_mean:.2g} batch(es) busy on average{ratio}{paused}"


@dataclass(frozen=True)
class RunBudget:
    """One run as the budget saw it.

    :param paused_s: seconds its chunks were paused or kept waiting, by reason (a signal's name,
        ``slots``, ``tenant_ceiling``, ``slow_start``, ``budget``, ``pause``, ``max_duty_cycle``), as written
        with each batch.
    :param hold: for a run without batches for a while: ``throttled`` (the budget paused purges since its
        last batch: held on purpose) or ``stuck`` (no batch for :data:`STUCK_AFTER` and no pause recorded
        since); None otherwise.
    """

    run_key: str
    paused_s: Mapping[str, float] = field(default_factory=dict)
    hold: str | None = None
    hold_text: str = ""
    pressure: RunPressure | None = None

    @property
    def paused_total_s(self) -> float:
        return sum(self.paused_s.values())

    def paused_text(self) -> str:
        """``replica_lag 2 min, max_duty_cycle 0.4 s``, longest first; ``—`` when never paused."""
        if not self.paused_s:
            return "—"
        ordered = sorted(self.paused_s.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{reason} {_seconds(seconds)}" for reason, seconds in ordered)


def span_end(run: RunSummary, now: datetime) -> datetime:
    """Where a run's span ends: verified, now while it runs, else its last batch."""
    if run.completed_at is not None:
        return run.completed_at
    return now if run.running or run.last_batch_at is None else run.last_batch_at


def run_pressures(
    conn: Any, ledger: Ledger, runs: Sequence[RunSummary], now: datetime, *, floor_level: int
) -> dict[str, RunPressure]:
    """The budget's observations during each run's span, summed up (one statement for every run); at the
    floor: paused, or at ``floor_level`` (the policy's) or below."""
    if not runs:
        return {}
    rows = dbapi.fetch_all(
        conn,
        "SELECT r.k, count(o.at), count(o.at) FILTER (WHERE o.paused),"
        f" count(o.at) FILTER (WHERE {at_floor_sql('o.')}),"
        " avg(CASE WHEN o.paused THEN 0 ELSE o.concurrency * o.duty END),"
        " max(CASE WHEN o.paused THEN 0 ELSE o.concurrency * o.duty END),"
        " percentile_cont(0.9) WITHIN GROUP (ORDER BY o.canary_ms / nullif(o.baseline_ms, 0)),"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY o.canary_ms), avg(o.baseline_ms)"
        " FROM unnest(%(keys)s::text[], %(starts)s::timestamptz[], %(ends)s::timestamptz[]) AS r(k, s, e)"
        f" LEFT JOIN {ledger.s}.budget_observations o ON o.scope = %(scope)s AND o.at BETWEEN r.s AND r.e"
        " GROUP BY r.k",
        {
            "keys": [r.run_key for r in runs],
            "starts": [r.planned_at for r in runs],
            "ends": [span_end(r, now) for r in runs],
            "scope": SCOPE,
            "floor_level": floor_level,
        },
    )
    out: dict[str, RunPressure] = {}
    for key, n, paused, floor, mean, top, ratio, canary, baseline in rows:
        if not n:
            continue
        out[key] = RunPressure(
            observations=int(n),
            paused_share=paused / n,
            floor_share=floor / n,
            allowed_mean=float(mean),
            allowed_max=float(top),
            canary_ratio_p90=ratio,
            canary_ms_median=canary,
            baseline_ms=baseline,
        )
    return out


@dataclass(frozen=True)
class HeldSince:
    """The budget's observations since a run's last batch: how many, how many paused, the last pause's
    reasons."""

    observations: int
    paused: int
    last_reasons: tuple[str, ...]


def held_since(conn: Any, ledger: Ledger, since: datetime) -> HeldSince:
    rows = dbapi.fetch_all(
        conn,
        f"SELECT count(*), count(*) FILTER (WHERE paused),"
        f" (SELECT reasons FROM {ledger.s}.budget_observations WHERE scope = %(scope)s AND paused"
        "  AND at > %(since)s::timestamptz ORDER BY at DESC LIMIT 1)"
        f" FROM {ledger.s}.budget_observations WHERE scope = %(scope)s AND at > %(since)s::timestamptz",
        {"scope": SCOPE, "since": since},
    )
    n, paused, reasons = rows[0]
    return HeldSince(int(n), int(paused), tuple(reasons or ()))


def hold_of(
    run: RunSummary, now: datetime, held: HeldSince | None, budget: BudgetView | None
) -> tuple[str | None, str]:
    """Whether a run that is not done is held on purpose or stuck, and the words the view shows.

    Throttled: the budget paused the purges since the run's last batch (its observations say so), or it is
    paused now. Stuck: no batch for :data:`STUCK_AFTER` and no pause recorded since. Paused time is written
    to a chunk with its next batch, so for the time since the last batch only the observations can tell.
    """
    if run.kind == "lone" or run.state == "complete" or not run.running:
        return None, ""
    idle = (now - (run.last_batch_at or run.planned_at)).total_seconds()
    paused_now = budget is not None and budget.live and budget.paused
    if paused_now or (held is not None and held.paused):
        reasons = budget.reasons if paused_now and budget is not None else (held.last_reasons if held else ())
        why = f": {'; '.join(reasons)}" if reasons else ""
        return THROTTLED, (
            f"throttled on purpose: the database budget {'is paused' if paused_now else 'paused the purges'}"
            f"{why}; no batch for {human_seconds(idle)}"
        )
    if idle > STUCK_AFTER.total_seconds():
        seen = held.observations if held is not None else 0
        observed = f" ({seen} observation(s) of the budget since, none paused)" if seen else ""
        return STUCK, f"stuck: no batch for {human_seconds(idle)} and no pause recorded since{observed}"
    return None, ""


def load_budget(
    conn: Any,
    policy: RetentionPolicy,
    version: int | None,
    runs: Sequence[RunSummary],
    now: datetime,
    state: Mapping[str, Any] | None,
) -> tuple[BudgetView | None, dict[str, RunBudget]]:
    """The budget's state and each run's pauses, hold and pressure, for a policy's panel.

    :param state: the budget's state as ``status`` read it (``Ledger.budget_snapshot``).
    """
    if not has_budget_tables(version):
        return None, {}
    ledger = Ledger(policy.ledger_schema)
    budget = budget_view(state, policy)
    pauses = {
        key: {reason: seconds for reason, seconds in by_reason.items() if seconds}
        for key, by_reason in ledger.paused_by_run(conn, [r.run_key for r in runs]).items()
    }
    pressures = run_pressures(conn, ledger, runs, now, floor_level=floor_level(policy.budget))
    out: dict[str, RunBudget] = {}
    for run in runs:
        held = held_since(conn, ledger, run.last_batch_at or run.planned_at) if run.running else None
        hold, text = hold_of(run, now, held, budget)
        out[run.run_key] = RunBudget(run.run_key, pauses.get(run.run_key, {}), hold, text, pressures.get(run.run_key))
    return budget, out


@dataclass(frozen=True)
class RunPoint:
    """One point of a run's pressure chart: the observations of one slice of the run's span."""

    at: datetime
    paused: bool
    canary_ms: float | None
    baseline_ms: float | None
    allowed: float  # batch slots times duty cycle, 0 while paused
    concurrency: int
    duty: float


def run_points(
    conn: Any, ledger: Ledger, start: datetime, end: datetime, buckets: int = RUN_CHART_BUCKETS
) -> list[RunPoint]:
    """The budget's observations from ``start`` to ``end``, averaged into at most ``buckets`` slices (a
    run of hours has thousands): a slice is paused if any of its observations was."""
    rows = dbapi.fetch_all(
        conn,
        "SELECT min(at), bool_or(paused), max(canary_ms), avg(baseline_ms),"
        " avg(CASE WHEN paused THEN 0 ELSE concurrency * duty END), min(concurrency), min(duty)"
        f" FROM {ledger.s}.budget_observations WHERE scope = %(scope)s"
        " AND at BETWEEN %(s)s::timestamptz AND %(e)s::timestamptz"
        " GROUP BY width_bucket(extract(epoch FROM at), extract(epoch FROM %(s)s::timestamptz),"
        " extract(epoch FROM %(e)s::timestamptz) + 0.001, %(n)s::integer) ORDER BY 1",
        {"scope": SCOPE, "s": start, "e": end, "n": buckets},
    )
    return [
        RunPoint(at, bool(paused), canary, baseline, float(allowed), int(c), float(d))
        for at, paused, canary, baseline, allowed, c, d in rows
    ]
