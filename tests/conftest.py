"""Shared fixtures: a real PostgreSQL (never a mock), both drivers, a schema per test, and a throwaway
Airflow home configured before anything imports Airflow.

PostgreSQL: the server of ``$RETENTION_TEST_DSN`` if set, else the local server (127.0.0.1:5432), else a
throwaway server from the ``pgserver`` package. The suite never works in a database it did not create:
it creates ``retention_test_<random>`` on that server at the start of the session (``DSN``) and, for
the Airflow-level tests, ``retention_e2e_<random>`` (``E2E_DSN``), and drops both at the end.

The drill that restarts the PostgreSQL server runs only with ``RETENTION_TEST_ALLOW_RESTART=1`` (CI sets
it): on a shared machine the server may be someone else's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import pytest
from psycopg2.extensions import make_dsn, parse_dsn

from airflow_retention.demo.airflow_home import airflow_environment
from airflow_retention.demo.postgres import admin_execute, resolve_dsn

REPO = Path(__file__).resolve().parents[1]
SERVER_DSN = resolve_dsn()
_RUN_ID = uuid.uuid4().hex[:8]
TEST_DB = f"retention_test_{_RUN_ID}"
DSN = make_dsn(SERVER_DSN, dbname=TEST_DB)
E2E_DB = f"retention_e2e_{_RUN_ID}"
E2E_DSN = make_dsn(SERVER_DSN, dbname=E2E_DB)
AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="retention-airflow-"))
DAGS_FOLDER = AIRFLOW_HOME / "dags"
POLICIES_FILE = AIRFLOW_HOME / "policies.yaml"
ALLOW_RESTART_ENV = "RETENTION_TEST_ALLOW_RESTART"
RESTART_TESTS = "server_restarted"

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
    admin_execute(SERVER_DSN, f'CREATE DATABASE "{TEST_DB}"', f'CREATE DATABASE "{E2E_DB}"')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    admin_execute(
        SERVER_DSN,
        f'DROP DATABASE IF EXISTS "{E2E_DB}" WITH (FORCE)',
        f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)',
    )
    shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the server-restart drill unless the environment allows a restart, and say so."""
    if os.environ.get(ALLOW_RESTART_ENV) == "1":
        return
    restart = [item for item in items if RESTART_TESTS in item.name]
    if not restart:
        return
    items[:] = [item for item in items if RESTART_TESTS not in item.name]
    config.hook.pytest_deselected(items=restart)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    message = (
        f"deselected {len(restart)} server-restart drill(s): they restart the PostgreSQL server, which on a"
        f" shared machine may be someone else's; set {ALLOW_RESTART_ENV}=1 to run them (.ci/run does)"
    )
    if reporter is not None:
        reporter.write_line(message, yellow=True)
    else:
        print(message)


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


@contextmanager
def throwaway_database(prefix: str) -> Iterator[str]:
    """A database of its own on the test server (``<prefix>_<random>``), dropped afterwards; yields its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin_execute(DSN, f'CREATE DATABASE "{name}"')
    try:
        yield make_dsn(DSN, dbname=name)
    finally:
        admin_execute(DSN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
