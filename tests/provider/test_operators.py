"""The cutoff is frozen from the run's own dates, never from the clock."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.model import RetentionPolicy

pytestmark = pytest.mark.airflow

POLICY = RetentionPolicy(name="p", conn_id="c", table="t", key_column="id", timestamp_column="ts", retention="30 days")
D = datetime(2026, 3, 31, tzinfo=timezone.utc)


def context(**values: object) -> dict[str, object]:
    run_after = values.pop("run_after", None)
    return {**values, "dag_run": SimpleNamespace(run_after=run_after)}


@pytest.mark.parametrize(
    ("ctx", "expected"),
    [
        # A scheduled or backfill run: its data interval end.
        (context(data_interval_end=D, logical_date=datetime(2026, 3, 30, tzinfo=timezone.utc)), "2026-03-01"),
        # A run with a logical date but no data interval.
        (context(logical_date=D), "2026-03-01"),
        # A manual run with no logical date: its run_after.
        (context(run_after=datetime(2026, 4, 30, 12, tzinfo=timezone.utc)), "2026-03-31T12:00"),
    ],
)
def test_cutoff_comes_from_the_run(ctx: dict[str, object], expected: str) -> None:
    from airflow_retention.operators.context import cutoff_from_context

    cutoff = cutoff_from_context(POLICY, ctx)  # type: ignore[arg-type]
    assert cutoff.isoformat().startswith(expected)
    assert cutoff.tzinfo is not None and cutoff.utcoffset().total_seconds() == 0


def test_two_runs_of_one_date_share_the_cutoff() -> None:
    from airflow_retention.operators.context import cutoff_from_context

    first = cutoff_from_context(POLICY, context(data_interval_end=D))  # type: ignore[arg-type]
    second = cutoff_from_context(POLICY, context(data_interval_end=D))  # type: ignore[arg-type]
    assert first == second


def test_a_run_without_any_date_is_refused() -> None:
    from airflow_retention.operators.context import cutoff_from_context

    with pytest.raises(PermanentError, match="no data interval end"):
        cutoff_from_context(POLICY, context())  # type: ignore[arg-type]
