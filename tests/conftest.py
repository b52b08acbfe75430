"""Shared fixtures: a real PostgreSQL (never a mock), both drivers, a schema per test, and a throwaway
Airflow home configured before anything imports Airflow.

PostgreSQL: the server of ``$RETENTION_TEST_DSN`` if set, else the local server (127.0.0.1:5432), else a
throwaway server from the ``pgserver`` package. The suite never works in a database it did not create:
it creates ``retention_test_<random>`` on that server at the start of the session (``DSN``) and, for
the Airflow-level tests, ``retention_e2e_<random>`` (``E2E_DSN``), and drops both at the end.

The drill that restarts the PostgreSQL server runs only with ``RETENTION_TEST_ALLOW_RESTART=1`` (CI sets
it): on a shared machine the server may be someone else's.

Under pytest-xdist (``./dev test`` runs ``-n 2 --dist loadgroup``) each worker is a pytest process of its own:
its own databases (the random names below are drawn per process), AIRFLOW_HOME and SQLite metadata. The tests
that share a costly fixture stay on one worker, and the longest start first (``tests/xdist_groups.py``).
"""

from __future__ import annotations

import json
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
from tests import xdist_groups

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

# A pytest-xdist worker inherits its controller's C-level environment, where GNU readline (loaded for pytest's
# pdb support) has set COLUMNS=80 and LINES=24 behind os.environ's back: the CLI would print 80-column tables
# where a single process prints 160 (airflow_retention/cli/render.py). A worker keeps only the COLUMNS and
# LINES of its controller's os.environ.
_TERMINAL_ENV = "RETENTION_TEST_TERMINAL"
if "PYTEST_XDIST_WORKER" in os.environ:
    _terminal = json.loads(os.environ.get(_TERMINAL_ENV, "{}"))
    for _key in ("COLUMNS", "LINES"):
        if _key in _terminal:
            os.environ[_key] = _terminal[_key]
        else:
            os.environ.pop(_key, None)
else:
    os.environ[_TERMINAL_ENV] = json.dumps({k: os.environ[k] for k in ("COLUMNS", "LINES") if k in os.environ})

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


def _xdist_controller(config: pytest.Config) -> bool:
    """pytest-xdist's controller: it only hands the tests to its workers and runs none itself."""
    return config.pluginmanager.has_plugin("dsession")


def pytest_configure(config: pytest.Config) -> None:
    xdist_groups.start_controller(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    xdist_groups.stop_controller(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return xdist_groups.make_scheduler(config, log) if xdist_groups.active(config) else None


def pytest_sessionstart(session: pytest.Session) -> None:
    if _xdist_controller(session.config):
        return
    admin_execute(SERVER_DSN, f'CREATE DATABASE "{TEST_DB}"', f'CREATE DATABASE "{E2E_DB}"')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _xdist_controller(session.config):
        shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)
        return
    admin_execute(
        SERVER_DSN,
        f'DROP DATABASE IF EXISTS "{E2E_DB}" WITH (FORCE)',
        f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)',
    )
    shutil.rmtree(AIRFLOW_HOME, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the tests' ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the server-restart drill unless the environment allows a restart, and say so.
    Under ``--dist loadgroup``: the longest groups first, and each test's group for the controller."""
    restart = [item for item in items if RESTART_TESTS in item.name]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if restart and workers > 1 and os.environ.get(ALLOW_RESTART_ENV) == "1":
        # The restart would cut every other worker's connections mid-test.
        raise pytest.UsageError(f"the server-restart drills run alone: with {ALLOW_RESTART_ENV}=1, run them with -n 0")
    if restart and os.environ.get(ALLOW_RESTART_ENV) != "1":
        items[:] = [item for item in items if RESTART_TESTS not in item.name]
        config.hook.pytest_deselected(items=restart)
        _say_restart_deselected(config, len(restart))
    if xdist_groups.active(config):
        xdist_groups.arrange(items)


def _say_restart_deselected(config: pytest.Config, count: int) -> None:
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its controller says it at the end
        workeroutput["restart_deselected"] = count
        return
    message = (
        f"deselected {count} server-restart drill(s): they restart the PostgreSQL server, which on a"
        f" shared machine may be someone else's; set {ALLOW_RESTART_ENV}=1 to run them (.ci/run does)"
    )
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, yellow=True)
    else:
        print(message)


_RESTART_DESELECTED = pytest.StashKey[int]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller: what a worker deselected (every worker collects the same tests)."""
    count = getattr(node, "workeroutput", {}).get("restart_deselected")
    if count:
        node.config.stash[_RESTART_DESELECTED] = count


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _xdist_controller(config) and _RESTART_DESELECTED in config.stash:
        _say_restart_deselected(config, config.stash[_RESTART_DESELECTED])


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
