"""Airflow's metadata database on the target's server (:mod:`airflow_retention.hooks.metadata_server`): its
name goes into the chunk's ``budget.ignore_databases`` only when it is a PostgreSQL database on the same server
as the target; and a chunk run through the hook does so. The SQL that reads the setting is tested in
tests/core/running/test_budget.py."""

from __future__ import annotations

import logging
import uuid
from contextlib import closing

import psycopg2
import pytest
from psycopg2.extensions import parse_dsn

from airflow_retention.core.ledger.records import Attempt
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.postgres import sqlalchemy_url
from airflow_retention.hooks.metadata_server import ignoring_metadata, metadata_database_on
from airflow_retention.hooks.retention import RetentionHook
from tests.conftest import E2E_DSN, throwaway_database
from tests.core.helpers import CUTOFF, create_events, eligible_ids, fill_events, make_policy, rows

METADATA = "postgresql+psycopg2://airflow:secret@127.0.0.1:5432/airflow_meta"


@pytest.mark.parametrize(
    ("host", "port", "url", "found"),
    [
        ("127.0.0.1", 5432, METADATA, "airflow_meta"),
        ("localhost", None, METADATA, "airflow_meta"),  # the same server by another name, the default port
        ("/var/run/postgresql", "5432", METADATA, "airflow_meta"),  # its socket
        ("127.0.0.1", 5433, METADATA, None),  # another server on this machine
        ("db.internal", 5432, METADATA, None),
        ("db.internal", 5432, "postgresql://u@DB.internal/meta", "meta"),
        ("127.0.0.1", 5432, "sqlite:////tmp/airflow.db", None),
        ("127.0.0.1", 5432, "postgresql://u@127.0.0.1:5432", None),  # no database named
        ("127.0.0.1", 5432, "not a url", None),
        ("127.0.0.1", "not a port", METADATA, None),
    ],
)
def test_the_metadata_database_counts_only_on_the_targets_server(
    host: str, port: object, url: str, found: str | None
) -> None:
    assert metadata_database_on(host, port, url) == found  # type: ignore[arg-type]


def test_the_metadata_database_is_read_from_airflows_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", METADATA)
    assert metadata_database_on("localhost", 5432) == "airflow_meta"
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:////tmp/airflow.db")
    assert metadata_database_on("localhost", 5432) is None


def _policy(**budget: object) -> RetentionPolicy:
    return RetentionPolicy.from_dict(
        {
            "name": "events_purge",
            "table": "public.events",
            "key_column": "id",
            "timestamp_column": "created_at",
            "retention": "30 days",
            "conn_id": "target",
            **({"budget": budget} if budget else {}),
        }
    )


def test_a_chunk_ignores_the_metadata_databases_sessions_when_it_is_beside_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", METADATA)
    policy = _policy(ignore_databases=["reports"])
    beside = ignoring_metadata(policy, "localhost", 5432)
    assert beside.budget.ignore_databases == ("reports", "airflow_meta")
    assert beside.budget.max_wal_rate == policy.budget.max_wal_rate and beside.name == policy.name
    assert ignoring_metadata(policy, "db.internal", 5432) is policy  # elsewhere: nothing to ignore
    assert ignoring_metadata(beside, "localhost", 5432) is beside  # named already
    # The target is the metadata database itself (a purge of Airflow's history): its scheduler is the
    # application to yield to.
    assert ignoring_metadata(policy, "localhost", 5432, "airflow_meta") is policy
    assert ignoring_metadata(policy, "localhost", 5432, "app").budget.ignore_databases == ("reports", "airflow_meta")
    off = _policy(enabled=False)
    assert ignoring_metadata(off, "localhost", 5432) is off  # no budget, no foreground to count


def test_the_hooks_chunk_names_a_metadata_database_beside_the_target(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the hook and the Airflow connection ``retention_target`` (127.0.0.1:5432): Airflow's metadata
    database on that server is ignored by the chunk's budget, said in the task log, and the chunk purges."""
    schema = f"meta_{uuid.uuid4().hex[:8]}"
    with closing(psycopg2.connect(E2E_DSN)) as admin, throwaway_database("retention_metadata") as metadata_dsn:
        admin.autocommit = True
        try:
            rows(admin, f'CREATE SCHEMA "{schema}"')
            table = create_events(admin, schema)
            fill_events(admin, table, 600)
            policy = make_policy(schema, budget={"period": "200ms", "connection_reserve": 0})
            monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", sqlalchemy_url(metadata_dsn))
            hook = RetentionHook(policy=policy)
            plan = hook.plan(CUTOFF, max_chunks=16)
            with caplog.at_level(logging.INFO, logger="airflow_retention.hooks.metadata_server"):
                for chunk in plan.chunks:
                    hook.run_chunk(plan.cutoff, chunk, Attempt(host="test"))
            metadata = parse_dsn(metadata_dsn)["dbname"]
            assert f"Airflow's metadata database {metadata} is on the target's server" in caplog.text
            assert eligible_ids(admin, table) == []
        finally:
            rows(admin, f'DROP SCHEMA IF EXISTS "{schema}", "{schema}_ledger" CASCADE')
