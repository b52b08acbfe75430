"""Policies file and connection resolution, without a running Airflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from psycopg2.extensions import parse_dsn

from airflow_retention.cli.config import (
    dsn_for_conn_id,
    dsn_from_airflow_json,
    dsn_from_airflow_uri,
    policies_path,
)
from airflow_retention.cli.errors import CliError
from airflow_retention.cli.timefmt import human_seconds, parse_instant


def test_airflow_uri_with_encoded_parts_and_extra() -> None:
    dsn = dsn_from_airflow_uri(
        "postgres://purge%40corp:p%2Fw%3D@db.example:6543/shop?sslmode=require&cursor=dictcursor"
    )
    assert parse_dsn(dsn) == {
        "host": "db.example",
        "port": "6543",
        "user": "purge@corp",
        "password": "p/w=",
        "dbname": "shop",
        "sslmode": "require",
    }
    socket = parse_dsn(dsn_from_airflow_uri("postgresql://postgres@%2Fvar%2Frun%2Fpostgresql/test"))
    assert socket == {"host": "/var/run/postgresql", "user": "postgres", "dbname": "test"}
    with pytest.raises(CliError, match="a Postgres connection is needed"):
        dsn_from_airflow_uri("mysql://x@y/z")


def test_airflow_json_with_extra_as_text() -> None:
    text = json.dumps(
        {
            "conn_type": "postgres",
            "host": "h",
            "port": 5432,
            "login": "u",
            "password": None,
            "schema": "d",
            "extra": json.dumps({"sslmode": "verify-full", "cursor": "realdictcursor"}),
        }
    )
    assert parse_dsn(dsn_from_airflow_json(text)) == {
        "host": "h",
        "port": "5432",
        "user": "u",
        "dbname": "d",
        "sslmode": "verify-full",
    }


def test_conn_id_from_environment_or_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", "/nonexistent-airflow-home")
    monkeypatch.delenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_PURGE_DB", "postgres://u@h:1/d")
    assert parse_dsn(dsn_for_conn_id("purge_db"))["dbname"] == "d"
    monkeypatch.delenv("AIRFLOW_CONN_PURGE_DB")
    with pytest.raises(
        CliError, match="connection 'purge_db' is not defined: give --dsn, or set AIRFLOW_CONN_PURGE_DB"
    ):
        dsn_for_conn_id("purge_db")


def test_policies_path_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIRFLOW_RETENTION_POLICIES", raising=False)
    assert policies_path(None) is None
    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "retention_policies.yaml").write_text("policies: []\n")
    assert policies_path(None) == Path("dags/retention_policies.yaml")
    monkeypatch.setenv("AIRFLOW_RETENTION_POLICIES", "/env.yaml")
    assert policies_path(None) == Path("/env.yaml")
    assert policies_path("/given.yaml") == Path("/given.yaml")


def test_dates_and_durations() -> None:
    assert parse_instant("2026-06-06", "--date").isoformat() == "2026-06-06T00:00:00+00:00"
    assert parse_instant("2026-06-06T02:00:00+02:00", "--date").isoformat() == "2026-06-06T00:00:00+00:00"
    assert parse_instant("2026-06-06T00:00:00Z", "--date").isoformat() == "2026-06-06T00:00:00+00:00"
    assert [human_seconds(s) for s in (None, 0, 42, 425, 3600 * 3 + 720, 86400 * 2 + 3600 * 4)] == [
        "—",
        "0 s",
        "42 s",
        "7 min 5 s",
        "3 h 12 min",
        "2 d 4 h",
    ]


def test_redact_keeps_no_secret_of_the_dsn() -> None:
    from airflow_retention.cli.config import redact

    dsn = "host=db.example port=6432 user=app dbname=shop password=pw-1 sslpassword=pw-2 sslkey=/keys/app.key"
    kept = {"host": "db.example", "port": "6432", "user": "app", "dbname": "shop", "sslkey": "/keys/app.key"}
    assert parse_dsn(redact(dsn)) == kept  # sslkey is a path, not a secret
    assert redact("not a dsn = =") == "<unparsable DSN>"
