"""The real ``airflow`` command in a throwaway AIRFLOW_HOME, as a new user runs it after
``airflow-retention init``: SQLite metadata, no example DAGs, the target connection from the environment."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from airflow_retention.demo.postgres import airflow_connection_json


def newcomer_env(home: Path, dags_folder: Path, dsn: str) -> dict[str, str]:
    """This process's environment without any Airflow setting of the test session, plus a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != "VIRTUAL_ENV"}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW_CONN_RETENTION_TARGET": airflow_connection_json(dsn),
        }
    )
    return env


def airflow(bin_dir: Path, env: dict[str, str], *args: str, timeout: float = 300) -> str:
    """Run ``airflow ARGS`` from ``bin_dir``; its stdout. A failure raises with both streams in the message."""
    done = subprocess.run(
        [str(bin_dir / "airflow"), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"airflow {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def airflow_json(bin_dir: Path, env: dict[str, str], *args: str) -> Any:
    """``airflow ARGS --output json``, parsed: the JSON is the last line of stdout (Airflow's log lines and
    warnings, such as the one about graphviz, may come before it on stdout too)."""
    out = airflow(bin_dir, env, *args, "--output", "json")
    return json.loads(out.strip().splitlines()[-1])


def listed_dag_ids(bin_dir: Path, env: dict[str, str]) -> list[str]:
    """The DAG ids ``airflow dags list`` shows once the dags folder has been parsed into the metadata
    database, as the dag-processor does; ``airflow db migrate`` first creates that database."""
    airflow(bin_dir, env, "db", "migrate")
    airflow(bin_dir, env, "dags", "reserialize")
    return sorted(d["dag_id"] for d in airflow_json(bin_dir, env, "dags", "list"))
