"""A database of its own per test, with pg_partman installed in schema ``partman``: partman's configuration
is per database, and ``run_maintenance()`` maintains every set of it, so one test's sets never meet
another's.

pg_partman comes from Debian's ``postgresql-15-partman`` (``.ci/run`` installs it). Without it these tests
fail, naming the package: they are the proof that the package works beside partman.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg2
import pytest

from tests.conftest import throwaway_database

from .helpers import Partman


def _install(dsn: str) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'pg_partman'")
            found = cur.fetchone()
            assert found is not None, (
                "pg_partman is not installed on this PostgreSQL server: install Debian's package"
                " postgresql-15-partman (apt-get install postgresql-15-partman; .ci/run does)"
            )
            cur.execute("CREATE SCHEMA partman")
            cur.execute("CREATE EXTENSION pg_partman SCHEMA partman")
            cur.execute("CREATE SCHEMA retention_detached")
    finally:
        conn.close()


@pytest.fixture
def pm() -> Iterator[Partman]:
    """A fresh database with pg_partman, and the helpers that drive partman and the purge in it."""
    with throwaway_database("retention_partman") as dsn:
        _install(dsn)
        helper = Partman(dsn)
        try:
            yield helper
        finally:
            helper.close()
