"""Parsing of the durations a policy holds: retention periods and timeouts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

import pendulum

_UNITS = {
    "ms": ("seconds", 0.001), "millisecond": ("seconds", 0.001),
    "s": ("seconds", 1), "sec": ("seconds", 1), "second": ("seconds", 1),
    "min": ("seconds", 60), "minute": ("seconds", 60),
    "h": ("seconds", 3600), "hour": ("seconds", 3600),
    "d": ("days", 1), "day": ("days", 1),
    "w": ("days", 7), "week": ("days", 7),
    "mon": ("months", 1), "month": ("months", 1),
    "y": ("months", 12), "year": ("months", 12),
}  # fmt: skip
_TERM = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)", re.IGNORECASE)
_ISO = re.compile(
    r"^P(?:(?P<y>\d+)Y)?(?:(?P<mo>\d+)M)?(?:(?P<w>\d+)W)?(?:(?P<d>\d+)D)?"
    r"(?:T(?:(?P<h>\d+)H)?(?:(?P<mi>\d+)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)


@dataclass(frozen=True)
class Retention:
    """A retention period as PostgreSQL's interval holds it: calendar months, days and seconds.

    Months and days are kept apart from seconds so that "1 year" means the same calendar date a year
    earlier (as ``now() - interval '1 year'`` would), not 365 times 86,400 seconds.
    """

    months: int = 0
    days: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, value: object) -> Retention:
        if isinstance(value, Retention):
            result = value
        elif isinstance(value, timedelta):
            result = cls(days=value.days, seconds=value.seconds + value.microseconds / 1e6)
        elif isinstance(value, str):
            result = _parse_text(value)
        else:
            raise ValueError(f"must be a duration such as '90 days', 'P90D' or a timedelta, got {type(value).__name__}")
        if result.months < 0 or result.days < 0 or result.seconds < 0 or result.is_zero:
            raise ValueError(f"must be a positive duration, got {value!r}")
        return result

    @property
    def is_zero(self) -> bool:
        return self.months == 0 and self.days == 0 and self.seconds == 0

    def before(self, instant: datetime) -> datetime:
        """The instant ``self`` before ``instant``, calendar-aware, in UTC."""
        moment = pendulum.instance(instant).in_timezone("UTC")
        return moment.subtract(months=self.months, days=self.days, seconds=self.seconds)

    def __str__(self) -> str:
        parts = []
        years, months = divmod(self.months, 12)
        for amount, unit in ((years, "year"), (months, "month"), (self.days, "day")):
            if amount:
                parts.append(f"{amount} {unit}{'s' if amount != 1 else ''}")
        hours, secs = divmod(self.seconds, 3600)
        if hours:
            parts.append(f"{int(hours)} hour{'s' if hours != 1 else ''}")
        if secs:
            secs = int(secs) if float(secs).is_integer() else secs
            parts.append(f"{secs} second{'s' if secs != 1 else ''}")
        return " ".join(parts)


def _parse_text(text: str) -> Retention:
    stripped = text.strip()
    iso = _ISO.match(stripped.upper())
    if iso and stripped.upper() not in ("P", "PT"):
        g = {k: float(v) if v else 0 for k, v in iso.groupdict().items()}
        return Retention(
            months=int(g["y"] * 12 + g["mo"]),
            days=int(g["w"] * 7 + g["d"]),
            seconds=g["h"] * 3600 + g["mi"] * 60 + g["s"],
        )
    totals = {"months": 0.0, "days": 0.0, "seconds": 0.0}
    pos = 0
    body = stripped.lower().replace(" and ", " ")
    for match in _TERM.finditer(body):
        if body[pos : match.start()].strip(" ,"):
            break
        word = match.group(2).lower()
        unit = _UNITS.get(word) or _UNITS.get(word[:-1] if word.endswith("s") else word)
        if unit is None:
            raise ValueError(f"unknown unit {match.group(2)!r} in {text!r}")
        field, factor = unit
        totals[field] += float(match.group(1)) * factor
        pos = match.end()
    if pos == 0 or body[pos:].strip(" ,"):
        raise ValueError(f"cannot read {text!r} as a duration (try '90 days', '12 hours' or 'P90D')")
    if not float(totals["months"]).is_integer() or not float(totals["days"]).is_integer():
        raise ValueError(f"months and days must be whole numbers in {text!r}")
    return Retention(months=int(totals["months"]), days=int(totals["days"]), seconds=totals["seconds"])


def parse_timeout_ms(value: object) -> int:
    """A timeout as whole milliseconds: an int (milliseconds), a timedelta, or text like '5s', '500ms'."""
    if isinstance(value, bool):
        raise ValueError("must be a duration, got a boolean")
    if isinstance(value, int):
        ms = value
    elif isinstance(value, timedelta):
        ms = round(value.total_seconds() * 1000)
    elif isinstance(value, str):
        parsed = _parse_text(value)
        if parsed.months or parsed.days:
            raise ValueError(f"{value!r} is too long for a timeout")
        ms = round(parsed.seconds * 1000)
    else:
        raise ValueError(f"must be a duration such as '5s' or '500ms', got {type(value).__name__}")
    if ms <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    if ms > 24 * 3600 * 1000:
        raise ValueError(f"{value!r} is longer than a day")
    return ms


# A cleanup window: at least a minute (a deadline sooner than the first batch is noise), at most a year.
MIN_WINDOW = timedelta(minutes=1)
MAX_WINDOW = timedelta(days=366)


def parse_window(value: object) -> timedelta:
    """A window of time such as ``cleanup_window``: text (``"24h"``, ``"2 days"``, ``"1 day 12 hours"``,
    ``"PT36H"``) or a ``timedelta``, in whole seconds, from 1 minute to 366 days. Months and years are
    refused: their length varies, and a deadline is a fixed span of time. A bare number is refused too
    (seconds or hours?)."""
    if isinstance(value, timedelta):
        window = value
    elif isinstance(value, str):
        parsed = _parse_text(value)
        if parsed.months:
            raise ValueError(f"{value!r}: months and years have no fixed length; write days ('30 days')")
        window = timedelta(days=parsed.days, seconds=parsed.seconds)
    else:
        raise ValueError(f"must be a duration such as '24h', '2 days' or 'PT36H', got {value!r}")
    if window.microseconds:
        raise ValueError(f"must be whole seconds, got {value!r}")
    if not MIN_WINDOW <= window <= MAX_WINDOW:
        raise ValueError(f"must be from 1 minute to 366 days, got {value!r}")
    return window


def format_window(window: timedelta) -> str:
    """A window as :func:`parse_window` reads it back: ``1 day``, ``1 day 12 hours``, ``90 seconds``."""
    return str(Retention(days=window.days, seconds=window.seconds))
