"""The cutoff of a run, frozen from the run's own date, and the run key derived from it."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow_retention.core import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy import RetentionPolicy


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


def anchor_of(policy: RetentionPolicy, cutoff: datetime) -> datetime:
    """The run date a cutoff was frozen from, for callers that have only the cutoff (a lone chunk, the
    CLI): ``cutoff + retention``. Exact for days and seconds; a month-end date clamped by the
    subtraction comes back a few days early, so planners pass the run's own date when they have it."""
    import pendulum

    r = policy.retention
    moment = pendulum.instance(as_utc(cutoff)).add(months=r.months, days=r.days, seconds=r.seconds)
    return datetime.fromtimestamp(moment.timestamp(), tz=timezone.utc)


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
