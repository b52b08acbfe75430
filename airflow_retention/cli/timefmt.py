"""Dates in, durations out: ``--date``/``--cutoff`` parsing and human durations ("3 h 12 min")."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from airflow_retention.cli.errors import CliError

NOT_MEASURED = "—"


def parse_instant(value: str, option: str) -> datetime:
    """``YYYY-MM-DD`` (midnight UTC) or an ISO 8601 datetime; a datetime without a zone is read as UTC."""
    text = value.strip()
    try:
        parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise CliError(f"{option} {value!r} is not a date (YYYY-MM-DD) or an ISO 8601 datetime") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


def run_cutoff(policy: Any, date: str | None, cutoff: str | None) -> datetime:
    """The cutoff of the run of ``date`` (its data interval end or logical date, as the DAG anchors it):
    ``date - retention``; or the cutoff given directly."""
    from airflow_retention.core.planning.cutoff import freeze_cutoff

    if cutoff is not None:
        return parse_instant(cutoff, "--cutoff")
    if date is None:
        raise CliError("give the run's --date (YYYY-MM-DD or ISO datetime) or its --cutoff")
    return freeze_cutoff(policy, parse_instant(date, "--date"))


def human_seconds(seconds: float | None, *, precise: bool = False) -> str:
    """Human durations: "0 s", "42 s", "7 min 5 s", "3 h 12 min", "2 d 4 h"; "—" when not measured.
    ``precise``: tenths of a second below 10 s ("0.4 s"), for the duration of quick runs."""
    if seconds is None:
        return NOT_MEASURED
    if precise and 0 <= seconds < 9.95:
        return f"{seconds:.1f} s"
    total = max(0, round(seconds))
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC (``2026-06-01T00:00:00+00:00``), or None."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat()


def short(value: datetime | None) -> str:
    """``2026-06-01 00:00:00Z`` for tables; "—" for None."""
    if value is None:
        return NOT_MEASURED
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
