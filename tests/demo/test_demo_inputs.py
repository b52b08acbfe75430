"""The demo checks its inputs before it drops or creates any database: a bad input is one line on stderr,
exit 2, and the database it would have recreated is left as it was."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.demo.__main__ import main
from airflow_retention.demo.postgres import admin_execute
from airflow_retention.scaffold import source
from tests.conftest import SERVER_DSN


@pytest.fixture(autouse=True)
def restore_policies_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo points the DAG file at its copy of the policies through the environment: undo that."""
    monkeypatch.setenv("AIRFLOW_RETENTION_POLICIES", os.environ.get("AIRFLOW_RETENTION_POLICIES", ""))


@pytest.fixture
def demo_db() -> Iterator[str]:
    """A database named like the demo's, holding a table the demo must not lose to a bad input."""
    name = f"retention_demotest_{uuid.uuid4().hex[:8]}"
    admin_execute(SERVER_DSN, f'CREATE DATABASE "{name}"')
    conn = psycopg2.connect(make_dsn(SERVER_DSN, dbname=name))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE keep_me (id int); INSERT INTO keep_me VALUES (1)")
    conn.close()
    yield name
    admin_execute(SERVER_DSN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def still_there(name: str) -> bool:
    conn = psycopg2.connect(make_dsn(SERVER_DSN, dbname=name))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM keep_me")
            return cur.fetchone()[0] == 1
    finally:
        conn.close()


def run_demo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_a_dags_folder_without_the_policies_file_stops_before_the_drop(
    demo_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_demo(capsys, "--dsn", SERVER_DSN, "--database", demo_db, "--dags", str(tmp_path))
    assert code == 2
    assert f"--dags {tmp_path}: needs retention_dags.py and retention_policies.yaml" in err
    assert "nothing was dropped or created" in err
    assert still_there(demo_db)


@pytest.mark.parametrize(
    "text", ["policies:\n  - name: broken\n    retention: soon\n", "policies: [broken\n"], ids=["policy", "yaml"]
)
def test_a_policies_file_that_does_not_parse_stops_before_the_drop(
    text: str, demo_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "retention_dags.py").write_text(source("retention_dags.py"))
    (tmp_path / "retention_policies.yaml").write_text(text)
    home = tmp_path / "home"
    code, err = run_demo(
        capsys, "--dsn", SERVER_DSN, "--database", demo_db, "--dags", str(tmp_path), "--home", str(home)
    )
    assert code == 2
    assert str(tmp_path / "retention_policies.yaml") in err and "broken" in err
    assert still_there(demo_db)


def test_a_server_that_does_not_answer_stops_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_demo(capsys, "--dsn", "postgresql://nobody@127.0.0.1:1/none", "--home", str(tmp_path))
    assert code == 2 and "does not answer" in err and "nothing was dropped or created" in err
    assert list(tmp_path.iterdir()) == []  # not even the DAG files were written


def test_a_database_name_that_needs_quoting_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_demo(capsys, "--dsn", SERVER_DSN, "--database", 'x"; DROP DATABASE postgres; --')
    assert code == 2 and "--database" in err
