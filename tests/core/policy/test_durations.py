"""Retention periods (calendar-aware) and timeouts. No database."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.planning.cutoff import format_cutoff, freeze_cutoff, parse_cutoff, run_anchor, run_key
from airflow_retention.core.policy.durations import Retention, parse_timeout_ms
from airflow_retention.core.policy.model import RetentionPolicy

UTC = timezone.utc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90 days", Retention(days=90)),
        ("90 DAYS", Retention(days=90)),
        ("P90D", Retention(days=90)),
        ("p90d", Retention(days=90)),
        ("1 day", Retention(days=1)),
        ("2 weeks", Retention(days=14)),
        ("P2W", Retention(days=14)),
        ("1 year", Retention(months=12)),
        ("P1Y", Retention(months=12)),
        ("1 year 2 months", Retention(months=14)),
        ("1 year, 2 months and 3 days", Retention(months=14, days=3)),
        ("P1Y2M3DT4H5M6S", Retention(months=14, days=3, seconds=4 * 3600 + 5 * 60 + 6)),
        ("12 hours", Retention(seconds=43200)),
        ("PT12H", Retention(seconds=43200)),
        ("90d", Retention(days=90)),
        ("1.5 hours", Retention(seconds=5400)),
    ],
)
def test_retention_text(text: str, expected: Retention) -> None:
    assert Retention.parse(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (timedelta(days=90), Retention(days=90)),
        (timedelta(days=2, hours=3), Retention(days=2, seconds=10800)),
        (timedelta(seconds=1, microseconds=500_000), Retention(seconds=1.5)),
    ],
)
def test_retention_timedelta(value: timedelta, expected: Retention) -> None:
    assert Retention.parse(value) == expected


@pytest.mark.parametrize(
    "value", ["", "P", "PT", "0 days", "-1 day", "1 fortnight", "days", "1.5 days", "90 days ago", 90, None]
)
def test_retention_refused(value: object) -> None:
    with pytest.raises(ValueError):
        Retention.parse(value)


@pytest.mark.parametrize(
    ("retention", "instant", "expected"),
    [
        ("1 year", datetime(2024, 3, 1, tzinfo=UTC), datetime(2023, 3, 1, tzinfo=UTC)),
        ("P1Y", datetime(2024, 3, 1, tzinfo=UTC), datetime(2023, 3, 1, tzinfo=UTC)),
        ("1 year", datetime(2024, 2, 29, 6, tzinfo=UTC), datetime(2023, 2, 28, 6, tzinfo=UTC)),
        ("1 month", datetime(2024, 3, 31, tzinfo=UTC), datetime(2024, 2, 29, tzinfo=UTC)),
        ("90 days", datetime(2024, 3, 1, tzinfo=UTC), datetime(2023, 12, 2, tzinfo=UTC)),
        ("12 hours", datetime(2024, 3, 1, tzinfo=UTC), datetime(2024, 2, 29, 12, tzinfo=UTC)),
        # an instant in another zone is the same instant in UTC
        ("1 day", datetime(2024, 3, 1, 2, tzinfo=timezone(timedelta(hours=2))), datetime(2024, 2, 29, tzinfo=UTC)),
    ],
)
def test_retention_before_is_calendar_aware(retention: str, instant: datetime, expected: datetime) -> None:
    result = Retention.parse(retention).before(instant)
    assert result == expected
    assert result.utcoffset() == timedelta(0)


def test_one_year_is_not_365_days_across_a_leap_day() -> None:
    instant = datetime(2024, 12, 1, tzinfo=UTC)
    assert Retention.parse("1 year").before(instant) == datetime(2023, 12, 1, tzinfo=UTC)
    assert Retention.parse("365 days").before(instant) == datetime(2023, 12, 2, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "text"),
    [("1 year", "1 year"), ("P14M", "1 year 2 months"), ("90 days", "90 days"), ("PT90M", "1 hour 1800 seconds")],
)
def test_retention_str(value: str, text: str) -> None:
    assert str(Retention.parse(value)) == text


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("5s", 5000),
        ("500ms", 500),
        ("500 ms", 500),
        ("1.5s", 1500),
        ("2 min", 120_000),
        ("1 hour", 3_600_000),
        ("PT1S", 1000),
        (250, 250),
        (timedelta(seconds=2), 2000),
        (timedelta(milliseconds=1), 1),
    ],
)
def test_timeout(value: object, ms: int) -> None:
    assert parse_timeout_ms(value) == ms


@pytest.mark.parametrize("value", ["0s", "0ms", 0, -5, "1 day", "25 hours", "fast", True, 1.5, None, timedelta(0)])
def test_timeout_refused(value: object) -> None:
    with pytest.raises(ValueError):
        parse_timeout_ms(value)


def _policy(**fields: object) -> RetentionPolicy:
    base = {"name": "p", "conn_id": "c", "table": "t", "key_column": "id", "timestamp_column": "ts"}
    return RetentionPolicy.from_dict({**base, "retention": "1 year", **fields})


def test_freeze_cutoff_and_run_key() -> None:
    policy = _policy()
    anchor = run_anchor(data_interval_end=datetime(2024, 3, 1, 0, 0, 0, 250, tzinfo=UTC))
    cutoff = freeze_cutoff(policy, anchor)
    assert cutoff == datetime(2023, 3, 1, 0, 0, 0, 250, tzinfo=UTC)
    assert format_cutoff(cutoff) == "2023-03-01T00:00:00.000250Z"
    assert parse_cutoff(format_cutoff(cutoff)) == cutoff
    assert run_key(policy, cutoff) == "p@2023-03-01T00:00:00.000250Z"
    assert run_key(_policy(dry_run=True), cutoff).endswith("#dry-run")


def test_run_anchor_prefers_interval_end_and_refuses_naive_dates() -> None:
    end, logical = datetime(2024, 3, 2, tzinfo=UTC), datetime(2024, 3, 1, tzinfo=UTC)
    assert run_anchor(data_interval_end=end, logical_date=logical) == end
    assert run_anchor(logical_date=logical, run_after=end) == logical
    with pytest.raises(PermanentError):
        run_anchor(logical_date=datetime(2024, 3, 1))
    with pytest.raises(PermanentError):
        run_anchor()
    with pytest.raises(PermanentError):
        parse_cutoff("2024-03-01T00:00:00")
    with pytest.raises(PermanentError):
        parse_cutoff("yesterday")
