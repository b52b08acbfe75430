"""``airflow-retention init --airflow-metadata`` as a user runs it, then the DAG it wrote, run by a real
Airflow 3 (``dag.test()``) against a populated metadata database: every table done in one run, and the
rows left those ``airflow db clean`` leaves on a copy of the same data with the run's own cutoff."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg2
import pytest

from airflow_retention.demo import airflow_metadata as am
from airflow_retention.demo.postgres import airflow_connection_json
from airflow_retention.scaffold import METADATA_FILES
from tests.conftest import DAGS_FOLDER, throwaway_database

pytestmark = pytest.mark.airflow

ANCHOR = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(days=1)
SHAPE = am.MetadataShape(dags=6, days=130, tasks=3, log_rows=20_000, job_rows=1_000)


@pytest.fixture
def scaffold() -> Iterator[list[Path]]:
    """The two files of ``init --airflow-metadata``, written into the tests' dags folder by the CLI."""
    cli = Path(sys.executable).with_name("airflow-retention")
    done = subprocess.run(
        [str(cli), "init", "--airflow-metadata", str(DAGS_FOLDER)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    written = [DAGS_FOLDER / name for name in METADATA_FILES]
    assert all(p.is_file() for p in written) and "airflow dags unpause retention_airflow_metadata" in done.stdout
    try:
        yield written
    finally:
        for path in written:
            path.unlink(missing_ok=True)


def test_the_scaffolded_dag_purges_a_metadata_database_as_db_clean_would(
    tmp_path: Path, scaffold: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, stdout=subprocess.DEVNULL)  # the tests' own Airflow
    with throwaway_database("retention_metadata_dag") as dsn:
        am.migrate(tmp_path / "target-airflow", dsn)
        seeded = am.seed_metadata(dsn, ANCHOR, SHAPE)
        theirs = am.clone_database(dsn, f"{psycopg2.extensions.parse_dsn(dsn)['dbname']}_db_clean")
        try:
            monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_METADATA", airflow_connection_json(dsn))
            from tests.provider.conftest import load_dag

            dag = load_dag("retention_airflow_metadata")
            run = dag.test(logical_date=ANCHOR.replace(hour=0))
            assert run.state == "success"
            cutoffs = {
                row[0]
                for row in am.rows(dsn, "SELECT DISTINCT cutoff FROM airflow_retention.runs WHERE state = 'complete'")
            }
            assert len(cutoffs) == 1, cutoffs  # every table's run of that DAG run, at one cutoff
            (cutoff,) = cutoffs
            groups = [c for c in dag.task_group.children.values() if hasattr(c, "children")]
            assert am.scalar(dsn, "SELECT count(DISTINCT policy) FROM airflow_retention.runs") == len(groups)
            am.db_clean(tmp_path / "target-airflow", theirs, cutoff)
            assert am.checksums(dsn, ANCHOR) == am.checksums(theirs, ANCHOR)
            after = am.table_counts(dsn)
            assert 0 < after["dag_run"] < seeded["dag_run"] and 0 < after["log"] < seeded["log"]
        finally:
            am.drop_database(theirs)
