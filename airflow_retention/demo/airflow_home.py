"""A throwaway Airflow home for the demo and the tests: SQLite metadata, our dags folder, no examples."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from airflow_retention.demo.postgres import airflow_connection_json


def airflow_environment(home: Path, dags_folder: Path, dsn: str, conn_id: str = "retention_target") -> dict[str, str]:
    """Environment variables for an Airflow process working in ``home`` against ``dsn``."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING"),
        f"AIRFLOW_CONN_{conn_id.upper()}": airflow_connection_json(dsn),
    }


def prepare_airflow_home(home: Path, dags_folder: Path, dsn: str) -> dict[str, str]:
    """Set the environment of this process for Airflow and migrate the SQLite metadata database.

    Must run before anything imports ``airflow`` in this process: Airflow reads its configuration once.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = airflow_environment(home, dags_folder, dsn)
    os.environ.update(env)
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    return env
