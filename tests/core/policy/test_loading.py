"""Policies files: the lenient and the strict load, malformed files, the repository's own policies file,
and a policy's round trip through ``policy_to_dict``. No database."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.durations import Retention
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.loading import load_policies, load_policies_lenient, policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy

from .helpers import build

REPO = Path(__file__).resolve().parents[3]


def test_policy_round_trips_through_dict() -> None:
    policy = build(
        table="public.Order",
        condition="status <> 'open'",
        tenant_column="tenant_id",
        archive_table="archive.Order",
        retention="1 year 2 days",
        lock_timeout="750ms",
        tags=["x"],
        dry_run=True,
    )
    assert RetentionPolicy.from_dict(policy_to_dict(policy)) == policy


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policies.yaml"
    path.write_text(text)
    return path


LENIENT_YAML = """
defaults:
  conn_id: target
  key_column: id
  timestamp_column: created_at
policies:
  - {name: good_one, table: public.a, retention: 30 days}
  - {name: bad_one, table: public.b, retention: 30 days, batch_size: 0}
  - {name: good_two, table: public.c, retention: P1Y}
  - {name: good_one, table: public.d, retention: 1 day}
  - {name: injected, table: 'public."x; drop table y', retention: 1 day}
"""


def test_lenient_load_keeps_good_policies_and_names_the_bad_ones(tmp_path: Path) -> None:
    policies, errors = load_policies_lenient(_write(tmp_path, LENIENT_YAML))
    assert [p.name for p in policies] == ["good_one", "good_two"]
    assert policies[0].table == TableName("public", "a")
    assert policies[1].retention == Retention(months=12)
    assert [(e.policy, e.field) for e in errors] == [
        ("bad_one", "batch_size"),
        ("good_one", "name"),
        ("injected", "table"),
    ]
    assert "more than one policy" in str(errors[1])


def test_strict_load_raises_the_first_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policies(_write(tmp_path, LENIENT_YAML))
    assert (info.value.policy, info.value.field) == ("bad_one", "batch_size")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[]", "policies"),
        ("policies: {}", "policies"),
        ("policies: []\nextra: 1", "extra"),
        ("policies: []\ndefaults: [1]", "defaults"),
        ("policies: [\n", None),
    ],
)
def test_malformed_file_is_refused(tmp_path: Path, text: str, field: str | None) -> None:
    with pytest.raises(PolicyError) as info:
        load_policies_lenient(_write(tmp_path, text))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("text", "field", "hint"),
    [
        # Not "must hold a 'policies' list": the typo is named first.
        ("polices:\n  - {name: a}\n", "polices", ": did you mean 'policies'?"),
        ("policies: []\ndefault: {}\n", "default", ": did you mean 'defaults'?"),
        ("policies: []\nextra: 1\n", "extra", " (known keys: defaults, policies)"),
    ],
)
def test_an_unknown_top_level_key_names_the_key_it_is_a_typo_of(
    tmp_path: Path, text: str, field: str, hint: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policies_lenient(path)
    assert str(info.value) == f"field {field!r}: unknown top-level key in {path}{hint}"


def test_non_mapping_entry_is_reported(tmp_path: Path) -> None:
    policies, errors = load_policies_lenient(_write(tmp_path, "policies:\n  - just a string\n"))
    assert policies == []
    assert [e.policy for e in errors] == ["#1"]


def test_repository_policies_file_loads() -> None:
    policies = load_policies(REPO / "dags" / "retention_policies.yaml")
    by_name = {p.name: p for p in policies}
    assert list(by_name) == ["webhook_deliveries", "tenant_events", "audit_log", "api_requests"]
    assert by_name["api_requests"].key_column is None and by_name["api_requests"].expired_partitions == "drop"
    assert [p.chunk_by for p in policies] == ["block", "key", "block", "block"]
    assert by_name["tenant_events"].tenant_column == "tenant_id"
    assert by_name["audit_log"].archive_table == TableName("audit", "audit_log_archive")
    assert by_name["audit_log"].retention == Retention(months=12)
    assert by_name["webhook_deliveries"].condition == "status in ('delivered', 'abandoned') and next_attempt_at is null"
    for policy in policies:  # defaults are merged under every policy
        assert (policy.conn_id, policy.lock_timeout_ms, policy.statement_timeout_ms) == (
            "retention_target",
            5000,
            60000,
        )
        assert policy.chunk_rows >= policy.batch_size
