"""Fixtures of the metadata tests: a metadata database migrated by the installed Airflow once per module,
and a fresh copy of it per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from airflow_retention.demo import airflow_metadata as am
from tests.conftest import throwaway_database


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A metadata database migrated by the installed Airflow, once per module: each test gets a copy."""
    with throwaway_database("retention_metadata_template") as dsn:
        am.migrate(tmp_path_factory.mktemp("airflow"), dsn)
        yield dsn


@pytest.fixture
def metadata_db(migrated: str) -> Iterator[str]:
    """A fresh copy of the migrated metadata database; dropped afterwards."""
    copy = am.clone_database(migrated, f"retention_metadata_{uuid.uuid4().hex[:8]}")
    yield copy
    am.drop_database(copy)
