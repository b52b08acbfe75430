"""The policy's ``budget`` field (:class:`~airflow_retention.core.policy.budget.Budget`): on by default, a
mapping of its settings or ``false``, and a bad value refused naming the field and the setting. No database."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.policy.budget import BUDGET_KEYS, Budget
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy

from .helpers import build, refused


def test_the_budget_is_on_by_default_with_its_defaults() -> None:
    budget = build().budget
    assert budget == Budget() and budget.enabled
    assert (budget.period_ms, budget.quiet_periods, budget.upper, budget.lower) == (2000, 3, 2.0, 1.4)
    assert (budget.upper_latency_ms, budget.lower_latency_ms) == (None, None)
    assert (budget.max_workers, budget.connection_reserve, budget.max_lock_waiters) == (4, 10, 0)
    assert (budget.max_replica_lag_ms, budget.max_archive_backlog) == (30_000, 42)
    assert (budget.yield_to_autovacuum, budget.on_unreadable) == (False, "open")
    assert build(budget=None).budget == Budget() and build(budget=True).budget == Budget()


@pytest.mark.parametrize(("value", "read"), [(None, "auto"), ("auto", "auto"), (12, 12.0), (2.5, 2.5), (False, None)])
def test_max_wal_rate_is_auto_a_rate_or_off(value: object, read: object) -> None:
    policy = build(budget={} if value is None else {"max_wal_rate": value})
    assert policy.budget.max_wal_rate == read
    assert build(budget=policy.budget.to_dict()).budget == policy.budget


@pytest.mark.parametrize(
    ("budget", "ceiling"),
    [({}, 2), ({"max_workers": 5}, 3), ({"max_workers": 1}, 1), ({"max_workers_per_tenant": 3}, 3),
     ({"max_workers": 2, "max_workers_per_tenant": 3}, 2), ({"max_workers_per_tenant": "auto", "max_workers": 8}, 4)],
)  # fmt: skip
def test_the_tenant_ceiling_is_half_the_workers_by_default_and_never_above_them(budget: Any, ceiling: int) -> None:
    policy = build(budget=budget)
    assert policy.budget.tenant_ceiling == ceiling
    assert build(budget=policy.budget.to_dict()).budget == policy.budget


@pytest.mark.parametrize("off", [False, "off", {"enabled": False}])
def test_false_turns_the_budget_off(off: object) -> None:
    policy = build(budget=off)
    assert not policy.budget.enabled
    assert "database budget" in policy.describe() and "off" in policy.describe().split("database budget", 1)[1]


def test_budget_settings_are_read_and_round_trip() -> None:
    policy = build(
        budget={
            "period": "500ms",
            "quiet_periods": 5,
            "upper": 3,
            "lower": 1.5,
            "max_workers": 2,
            "connection_reserve": 20,
            "max_lock_waiters": 3,
            "max_replica_lag": "1 min",
            "max_archive_backlog": 10,
            "yield_to_autovacuum": True,
            "on_unreadable": "closed",
            "ignore_databases": ["airflow", "airflow"],
        }
    )
    b = policy.budget
    assert b.ignore_databases == ("airflow",) and Budget().ignore_databases == ()
    assert (b.period_ms, b.quiet_periods, b.upper, b.lower, b.max_workers) == (500, 5, 3.0, 1.5, 2)
    assert (b.connection_reserve, b.max_lock_waiters, b.max_replica_lag_ms, b.max_archive_backlog) == (
        20,
        3,
        60_000,
        10,
    )
    assert b.yield_to_autovacuum and b.on_unreadable == "closed"
    assert RetentionPolicy.from_dict(policy_to_dict(policy)) == policy
    absolute = build(budget={"upper_latency": "50ms", "lower_latency": 20}).budget
    assert (absolute.upper_latency_ms, absolute.lower_latency_ms) == (50.0, 20.0)
    assert RetentionPolicy.from_dict(policy_to_dict(build(budget=False))).budget == Budget(enabled=False)
    assert set(Budget().to_dict()) == set(BUDGET_KEYS)


@pytest.mark.parametrize(
    ("budget", "words"),
    [
        ({"periode": "1s"}, "unknown key 'periode': did you mean 'period'?"),
        ({"max_worker": 2}, "unknown key 'max_worker': did you mean 'max_workers'?"),
        ("fast", "must be a mapping of budget settings, true or false, got 'fast'"),
        (3, "must be a mapping of budget settings"),
        ({"enabled": "yes"}, "enabled: must be true or false, got 'yes'"),
        ({"yield_to_autovacuum": 1}, "yield_to_autovacuum: must be true or false"),
        ({"period": "50ms"}, "period: must be at least 100ms"),
        ({"period": "soon"}, "period: cannot read 'soon'"),
        ({"max_replica_lag": "later"}, "max_replica_lag: cannot read 'later'"),
        ({"quiet_periods": 0}, "quiet_periods: must be an integer from 1 to 1000, got 0"),
        ({"quiet_periods": True}, "quiet_periods: must be an integer from 1 to 1000, got True"),
        ({"max_workers": 0}, "max_workers: must be an integer from 1 to 64, got 0"),
        ({"max_wal_rate": "fast"}, "max_wal_rate: must be 'auto', false or MB/s above 0, got 'fast'"),
        ({"max_wal_rate": 0}, "max_wal_rate: must be 'auto', false or MB/s above 0, got 0"),
        ({"max_workers": 65}, "max_workers: must be an integer from 1 to 64, got 65"),
        ({"max_workers": "2"}, "max_workers: must be an integer from 1 to 64, got '2'"),
        ({"max_workers_per_tenant": 0}, "max_workers_per_tenant: must be 'auto' or an integer from 1 to 64, got 0"),
        ({"max_workers_per_tenant": "half"}, "max_workers_per_tenant: must be 'auto' or an integer from 1 to 64"),
        ({"max_workers_per_tenant": True}, "max_workers_per_tenant: must be 'auto' or an integer from 1 to 64"),
        ({"connection_reserve": -1}, "connection_reserve: must be an integer from 0 to 10000"),
        ({"max_lock_waiters": 1.5}, "max_lock_waiters: must be an integer from 0 to 10000"),
        ({"max_archive_backlog": -1}, "max_archive_backlog: must be an integer from 0 to 1000000"),
        ({"upper": 0.5}, "upper: must be a multiple of the baseline latency from 1 to 100, got 0.5"),
        ({"lower": "1.2"}, "lower: must be a multiple of the baseline latency from 1 to 100"),
        ({"upper": 1.2, "lower": 1.4}, "lower (1.4) must be below upper (1.2)"),
        ({"upper": 2, "lower": 2}, "lower (2) must be below upper (2)"),
        ({"upper_latency": "50ms"}, "upper_latency and lower_latency go together"),
        ({"lower_latency": "5ms"}, "upper_latency and lower_latency go together"),
        ({"upper_latency": "5ms", "lower_latency": "5ms"}, "lower_latency must be below upper_latency"),
        ({"upper_latency": "fast", "lower_latency": "5ms"}, "upper_latency: cannot read 'fast'"),
        ({"on_unreadable": "ignore"}, "on_unreadable: must be 'open' or 'closed', got 'ignore'"),
        ({"min_duty": 0.001}, "min_duty: must be a share of the time from 0.0025 to 0.1, got 0.001"),
        ({"min_duty": 0.5}, "min_duty: must be a share of the time from 0.0025 to 0.1, got 0.5"),
        ({"min_duty": "1%"}, "min_duty: must be a share of the time from 0.0025 to 0.1, got '1%'"),
        ({"min_duty": True}, "min_duty: must be a share of the time from 0.0025 to 0.1, got True"),
        ({"ignore_databases": "airflow"}, "ignore_databases: must be a list of database names, got 'airflow'"),
        ({"ignore_databases": ["airflow", ""]}, "ignore_databases: must be a list of database names"),
        ({"ignore_databases": [3]}, "ignore_databases: must be a list of database names, got [3]"),
    ],
)
def test_bad_budget_settings_name_the_field_and_the_setting(budget: Any, words: str) -> None:
    error = refused("budget", budget=budget)
    assert words in str(error), str(error)
    assert str(error).startswith("policy 'events_purge', field 'budget': ")
