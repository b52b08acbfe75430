"""Metrics of airflow-retention, sent through Airflow's own ``Stats`` (StatsD, Datadog or OpenTelemetry,
as ``[metrics]`` configures; nothing is sent when metrics are off).

Every name carries the policy, so that plain StatsD (no tags) keeps policies apart; the same values go
out as tags (``policy``, ``table``) for backends that take them. The names are documented in
``docs/operators.md`` (Metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

from airflow_retention.compat import stats
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import BatchReport
from airflow_retention.core.running.slo import CleanupSlo

log = logging.getLogger(__name__)

PREFIX = "retention"


def _name(metric: str, policy: RetentionPolicy) -> str:
    return f"{PREFIX}.{metric}.{policy.name}"


def _tags(policy: RetentionPolicy) -> dict[str, str]:
    return {"policy": policy.name, "table": str(policy.table)}


def _safely(fn: object, *args: object, **kwargs: object) -> None:
    # A metrics backend that is down must never fail a purge.
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        log.debug("could not send a metric", exc_info=True)


def batch(policy: RetentionPolicy, report: BatchReport) -> None:
    """After each committed batch: rows deleted (or matched in a dry run), its duration, its size,
    and the pauses the throttle took before it."""
    tags = _tags(policy)
    rows = report.matched if policy.dry_run else report.deleted
    _safely(stats.incr, _name("rows_deleted" if not policy.dry_run else "rows_matched", policy), rows, tags=tags)
    _safely(stats.timing, _name("batch_seconds", policy), timedelta(milliseconds=report.ms), tags=tags)
    _safely(stats.gauge, _name("batch_size", policy), report.size, tags=tags)
    if report.backoffs:
        _safely(stats.incr, _name("backoffs", policy), report.backoffs, tags=tags)


def partition(policy: RetentionPolicy, outcome: str, rows: int, seconds: float) -> None:
    """A whole partition dropped or detached by a partition chunk: its rows count as deleted."""
    tags = {**_tags(policy), "outcome": outcome}
    _safely(stats.incr, _name("rows_deleted", policy), rows, tags=tags)
    _safely(stats.incr, _name(f"partitions_{outcome}", policy), 1, tags=tags)
    _safely(stats.timing, _name("partition_seconds", policy), timedelta(seconds=seconds), tags=tags)


def chunk_retried(policy: RetentionPolicy) -> None:
    """A chunk task started on a retry (try 2 or later): a redelivery."""
    _safely(stats.incr, _name("chunks_retried", policy), 1, tags=_tags(policy))


def chunk_done(policy: RetentionPolicy, seconds: float) -> None:
    _safely(stats.incr, _name("chunks_completed", policy), 1, tags=_tags(policy))
    _safely(stats.timing, _name("chunk_seconds", policy), timedelta(seconds=seconds), tags=_tags(policy))


def cleanup_lag(policy: RetentionPolicy, seconds: float, left: int) -> None:
    """At the end of a run: how overdue the oldest eligible row left behind is, and how many are left."""
    _safely(stats.gauge, _name("cleanup_lag_seconds", policy), seconds, tags=_tags(policy))
    _safely(stats.gauge, _name("eligible_left", policy), left, tags=_tags(policy))


def paused(policy: RetentionPolicy, seconds_by_reason: Mapping[str, float]) -> None:
    """When a chunk task finishes its chunk: the time it paused for the database budget, per reason
    (``retention.paused_ms_<reason>.<policy>``, in whole milliseconds: a counter takes integers everywhere)."""
    for reason, seconds in seconds_by_reason.items():
        ms = round(seconds * 1000)
        if ms > 0:
            tags = {**_tags(policy), "reason": reason}
            _safely(stats.incr, _name(f"paused_ms_{_metric_part(reason)}", policy), ms, tags=tags)


def budget(policy: RetentionPolicy, *, concurrency: int, duty: float, paused: bool) -> None:
    """The database budget as it stands: batches allowed at once, their duty cycle, and whether it pauses."""
    tags = _tags(policy)
    _safely(stats.gauge, _name("budget_concurrency", policy), concurrency, tags=tags)
    _safely(stats.gauge, _name("budget_duty", policy), duty, tags=tags)
    _safely(stats.gauge, _name("budget_paused", policy), 1 if paused else 0, tags=tags)


def slo(policy: RetentionPolicy, cleanup: CleanupSlo) -> None:
    """When ``verify`` completes a run: the cleanup SLO (core/running/slo.py) and the share of the last run
    the budget held at its floor; ``slo_keeps_up`` is 1 or 0, not sent while μ is unknown."""
    tags = _tags(policy)
    if cleanup.keeps_up is not None:
        _safely(stats.gauge, _name("slo_keeps_up", policy), 1 if cleanup.keeps_up else 0, tags=tags)
    _safely(stats.gauge, _name("budget_floor_share", policy), cleanup.floor_share, tags=tags)
    _safely(stats.gauge, _name("slo_lambda_rows_per_day", policy), cleanup.lambda_rows_per_day, tags=tags)
    _safely(stats.gauge, _name("slo_concurrency", policy), cleanup.concurrency, tags=tags)
    if cleanup.mu_rows_per_s is not None:
        _safely(stats.gauge, _name("slo_mu_rows_per_s", policy), cleanup.mu_rows_per_s, tags=tags)


def _metric_part(text: str) -> str:
    """A reason as one part of a metric name (letters, digits and underscores)."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text) or "unknown"
