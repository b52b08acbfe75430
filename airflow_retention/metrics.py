"""Metrics of airflow-retention, sent through Airflow's own ``Stats`` (StatsD, Datadog or OpenTelemetry,
as ``[metrics]`` configures; nothing is sent when metrics are off).

Every name carries the policy, so that plain StatsD (no tags) keeps policies apart; the same values go
out as tags (``policy``, ``table``) for backends that take them. The names are documented in
``docs/operators.md`` (Metrics).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from airflow_retention.compat import stats
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import BatchReport

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
