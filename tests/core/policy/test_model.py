"""``RetentionPolicy`` as built from its YAML mapping: normalised values, unknown and missing keys (with the
key a typo was meant to be), and its description. No database."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.durations import Retention
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy

from .helpers import BASE, build, refused


def test_minimal_policy_is_normalised() -> None:
    policy = build(lock_timeout="2s", statement_timeout="500ms", tags=["a", "b"], start_date="2026-01-01")
    assert policy.table == TableName("public", "events")
    assert policy.retention == Retention(days=90)
    assert (policy.lock_timeout_ms, policy.statement_timeout_ms) == (2000, 500)
    assert policy.tags == ("a", "b")
    assert policy.start_date == datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert (policy.batch_size, policy.chunk_rows, policy.dry_run) == (5000, None, False)  # None: sized by time


@pytest.mark.parametrize("key", ["colour", "batchsize", "lock_timeout_ms", "Table"])
def test_unknown_key_is_refused(key: str) -> None:
    refused(key, **{key: 1})


def test_unknown_key_in_defaults_is_refused() -> None:
    with pytest.raises(PolicyError) as info:
        RetentionPolicy.from_dict(BASE, defaults={"bogus": 1})
    assert (info.value.policy, info.value.field) == ("events_purge", "bogus")


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("conditon", "condition"),
        ("retension", "retention"),
        ("lock_timeout_ms", "lock_timeout"),
        ("chunkrows", "chunk_rows"),
        ("tennant_column", "tenant_column"),
        ("shedule", "schedule"),
    ],
)
def test_an_unknown_key_names_the_key_it_is_a_typo_of(key: str, meant: str) -> None:
    error = refused(key, **{key: 1})
    assert str(error) == f"policy 'events_purge', field {key!r}: unknown key: did you mean {meant!r}?"


def test_an_unknown_key_like_no_known_one_lists_them_all() -> None:
    message = str(refused("zzz", zzz=1))
    assert "did you mean" not in message
    head, listed = message.split(": unknown key (known keys: ")
    assert head == "policy 'events_purge', field 'zzz'" and listed.endswith(")")
    keys = listed[:-1].split(", ")
    assert keys == sorted(keys) and {"condition", "retention", "table", "throttle", "lock_timeout"} <= set(keys)
    assert len(keys) > 30 and "lock_timeout_ms" not in keys  # the YAML spelling


@pytest.mark.parametrize(
    ("throttle", "message"),
    [
        ({"max_lag": "1s"}, "unknown key 'max_lag': did you mean 'max_replica_lag'?"),
        ({"backof": "1s"}, "unknown key 'backof': did you mean 'backoff'?"),
        (
            {"zzz": 1},
            "unknown key 'zzz' (known keys: backoff, give_up_after, max_lock_waiters, max_replica_lag, probe,"
            " probe_max)",
        ),
    ],
)
def test_an_unknown_throttle_key_names_the_key_it_is_a_typo_of(throttle: dict[str, Any], message: str) -> None:
    assert str(refused("throttle", throttle=throttle)) == f"policy 'events_purge', field 'throttle': {message}"


@pytest.mark.parametrize("missing", ["conn_id", "table", "timestamp_column", "retention"])
def test_missing_required_key_is_refused(missing: str) -> None:
    data = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(PolicyError) as info:
        RetentionPolicy.from_dict(data)
    assert (info.value.policy, info.value.field) == ("events_purge", missing)


def test_describe_names_the_cutoff_rule() -> None:
    text = build(condition="status <> 'open'").describe()
    assert "`created_at` < cutoff and the condition holds" in text
    assert "90 days" in text
