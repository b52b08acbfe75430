"""Shared fixtures: a real PostgreSQL (never a mock), both drivers, a schema per test, and a throwaway
Airflow home configured before anything imports Airflow.

PostgreSQL: ``$RETENTION_TEST_DSN`` if set, else the local server (127.0.0.1:5432, database ``test``),
else a throwaway server from the ``pgserver`` package. Airflow-level tests get a database of their own
on that server, created here and dropped at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import pytest
from psycopg2.extensions import make_dsn, parse_dsn

from airflow_retention.demo.airflow_home import airflow_environment
from airflow_retention.demo.postgres import admin_execute, resolve_dsn

REPO = Path(__file__).resolve().parents[1]
DSN = resolve_dsn()
_RUN_ID = uuid.uuid4().hex[:8]
E2E_DB = f"retention_e2e_{_RUN_ID}"
E2E_DSN = make_dsn(DSN, dbname=E2E_DB)
AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="retention-airflow-"))
DAGS_FOLDER = AIRFLOW_HOME / "dags"
POLICIES_FILE = AIRFLOW_HOME / "policies.yaml"

# Airflow reads its configuration once, at import: set it before any test module imports Airflow.
os.environ.update(airflow_environment(AIRFLOW_HOME, DAGS_FOLDER, E2E_DSN))
os.environ["AIRFLOW_RETENTION_POLICIES"] = str(POLICIES_FILE)
DAGS_FOLDER.mkdir(parents=True)
shutil.copy(REPO / "dags" / "retention_dags.py", DAGS_FOLDER / "retention_dags.py")
POLICIES_FILE.write_text((REPO / "dags" / "retention_policies.yaml").read_text())


def _admin(dsn: str = DSN) -> Any:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    return conn


def pytest_sessionstart(session: pytest.Session) -> None:
    admin_execute(DSN, f'CREATE DATABASE "{E2E_DB}"')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    admin_execute(DSN, f'DROP DATABASE IF EXISTS "{E2E_DB}" WITH (FORCE)')
    shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def dsn() -> str:
    return DSN


@pytest.fixture
def admin() -> Iterator[Any]:
    """An autocommit psycopg2 connection for setting up and inspecting tables."""
    conn = _admin()
    yield conn
    conn.close()


@pytest.fixture
def schema(admin: Any) -> Iterator[str]:
    """A fresh schema for the test's tables, dropped afterwards; its ledger goes in ``<schema>_ledger``."""
    name = f"t_{uuid.uuid4().hex[:10]}"
    with admin.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{name}"')
    yield name
    with admin.cursor() as cur:
        cur.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        cur.execute(f'DROP SCHEMA IF EXISTS "{name}_ledger" CASCADE')


def connect(driver: str, dsn: str = DSN) -> Any:
    """A connection of the given driver, not in autocommit, as PostgresHook hands them out."""
    if driver == "psycopg":
        return psycopg.connect(dsn)
    return psycopg2.connect(dsn)


@pytest.fixture(params=["psycopg2", "psycopg"])
def driver(request: pytest.FixtureRequest) -> str:
    """Every engine test runs on both drivers: psycopg 3 (Airflow 3.2+) and psycopg2 (older)."""
    return request.param


@pytest.fixture
def conn(driver: str) -> Iterator[Any]:
    c = connect(driver)
    yield c
    c.close()


def dsn_parts() -> dict[str, str]:
    return parse_dsn(DSN)
