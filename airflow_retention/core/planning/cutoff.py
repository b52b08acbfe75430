"""The cutoff of a run, frozen from the run's own date, and the run key derived from it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.model import RetentionPolicy


def run_anchor(
    *,
    data_interval_end: datetime | None = None,
    logical_date: datetime | None = None,
    run_after: datetime | None = None,
) -> datetime:
    """The instant a run stands for: its data interval end, else its logical date, else its run_after
    (a manual run in Airflow 3 may have no logical date). Never the clock."""
    for value in (data_interval_end, logical_date, run_after):
        if value is not None:
            if value.tzinfo is None:
                raise PermanentError(f"run date {value!r} has no time zone; refusing to guess one")
            return value
    raise PermanentError("the run has no data interval end, logical date or run_after to freeze a cutoff from")


def freeze_cutoff(policy: RetentionPolicy, anchor: datetime) -> datetime:
    """The run's cutoff: ``anchor - retention`` as an aware UTC instant (microseconds kept)."""
    moment = policy.retention.before(anchor)
    return datetime.fromtimestamp(moment.timestamp(), tz=timezone.utc).replace(microsecond=moment.microsecond)


def resolve_run_date(policy: RetentionPolicy, cutoff: datetime, run_date: datetime | None = None) -> datetime | None:
    """The date of the run whose cutoff is ``cutoff``, from which per-tenant cutoffs are frozen.

    Given (the DAG's plan task, a lone chunk without an explicit cutoff, ``airflow-retention plan
    --date``), it must be the date ``cutoff`` was frozen from. Not given (a caller that has only a
    cutoff), it is rebuilt as ``cutoff + retention`` only when that is the one date whose cutoff is
    ``cutoff``: month arithmetic does not round-trip at month ends (2026-03-28 to 03-31 all freeze
    02-28 with ``1 month``), so there it is None and a per-tenant retention cannot be frozen.

    :raises PermanentError: a run date without a time zone, or one that does not freeze ``cutoff``.
    """
    cutoff = as_utc(cutoff)
    if run_date is not None:
        if run_date.tzinfo is None:
            raise PermanentError(f"run date {run_date!r} has no time zone; refusing to guess one")
        if freeze_cutoff(policy, run_date) != cutoff:
            raise PermanentError(
                f"policy {policy.name!r}: run date {format_cutoff(run_date)} minus retention {policy.retention} is"
                f" {format_cutoff(freeze_cutoff(policy, run_date))}, not the cutoff {format_cutoff(cutoff)}"
            )
        return as_utc(run_date)
    return _only_run_date(policy, cutoff)


def _only_run_date(policy: RetentionPolicy, cutoff: datetime) -> datetime | None:
    """``cutoff + retention`` when it is the only run date whose cutoff is ``cutoff``, else None."""
    import pendulum

    r = policy.retention
    moment = pendulum.instance(cutoff).in_timezone("UTC").add(months=r.months, days=r.days, seconds=r.seconds)
    candidate = datetime.fromtimestamp(moment.timestamp(), tz=timezone.utc).replace(microsecond=moment.microsecond)
    if freeze_cutoff(policy, candidate) != cutoff:
        return None  # a month-end cutoff no run date gives (01-31 with "1 month")
    # Subtracting months clamps at month ends, so later dates (a whole number of days later, at the same
    # time of day) may give the same cutoff; with the map monotonic, the next day tells.
    if r.months and freeze_cutoff(policy, candidate + timedelta(days=1)) == cutoff:
        return None
    return candidate


def require_run_date(policy: RetentionPolicy, cutoff: datetime, run_date: datetime | None) -> datetime:
    """The run date of :func:`resolve_run_date`, for freezing per-tenant cutoffs; raises when it cannot
    be told from ``cutoff`` alone."""
    resolved = resolve_run_date(policy, cutoff, run_date)
    if resolved is None:
        raise PermanentError(
            f"policy {policy.name!r}: per-tenant retention is frozen from the run's date, and cutoff"
            f" {format_cutoff(cutoff)} does not tell it (retention {policy.retention} gives that cutoff for"
            " several run dates, or none, at month ends): give the run's date (airflow-retention plan --date;"
            " a lone RetentionChunkOperator without cutoff=); nothing was deleted"
        )
    return resolved


def format_cutoff(cutoff: datetime) -> str:
    """ISO 8601 in UTC with a ``Z``, the spelling used in run keys, XCom and logs."""
    utc = as_utc(cutoff)
    text = utc.strftime("%Y-%m-%dT%H:%M:%S")
    if utc.microsecond:
        text += f".{utc.microsecond:06d}"
    return text + "Z"


def parse_cutoff(value: str | datetime) -> datetime:
    """Read a cutoff back from XCom or a template; it must carry a time zone."""
    if isinstance(value, datetime):
        return as_utc(value)
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        raise PermanentError(f"cutoff {value!r} is not an ISO 8601 instant") from None
    return as_utc(parsed)


def as_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise PermanentError(f"cutoff {value!r} has no time zone; refusing to guess one")
    return value.astimezone(timezone.utc)


def run_key(policy: RetentionPolicy, cutoff: datetime, *, lone: bool = False) -> str:
    """The identity of a run: the policy plus its frozen cutoff. A dry run, and the run of chunks
    purged without a planner, are runs of their own."""
    return f"{policy.name}@{format_cutoff(cutoff)}" + ("#dry-run" if policy.dry_run else "") + ("#lone" if lone else "")


def refuse_future_cutoff(conn: Any, policy: RetentionPolicy, cutoff: datetime) -> None:
    """A cutoff after the database's clock would purge rows that have not expired yet: refuse it."""
    (now,) = dbapi.fetch_all(conn, "SELECT now()")[0]
    if cutoff > now:
        raise PermanentError(
            f"policy {policy.name!r}: cutoff {format_cutoff(cutoff)} is in the future (database time is"
            f" {format_cutoff(now)}); refusing to purge rows that have not expired yet"
        )
