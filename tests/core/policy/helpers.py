"""The policy every test of tests/core/policy starts from, and a check that a field is refused."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.model import RetentionPolicy

BASE: dict[str, Any] = {
    "name": "events_purge",
    "conn_id": "retention_target",
    "table": "public.events",
    "key_column": "id",
    "timestamp_column": "created_at",
    "retention": "90 days",
}


def build(**fields: Any) -> RetentionPolicy:
    return RetentionPolicy.from_dict({**BASE, **fields})


def refused(field: str, **fields: Any) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        build(**fields)
    error = info.value
    assert error.policy == fields.get("name", BASE["name"])
    assert error.field == field
    assert f"policy {error.policy!r}" in str(error)
    assert f"field {field!r}" in str(error)
    return error
