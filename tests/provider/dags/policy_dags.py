"""Test DAGs: one retention DAG per policy of the file named by RETENTION_TEST_POLICIES (the Airflow
tests write it), through the same factory as the shipped dags/retention_dags.py."""

from __future__ import annotations

import os
from pathlib import Path

from airflow_retention.dag_factory import build_dags_from_yaml

_path = Path(os.environ.get("RETENTION_TEST_POLICIES", "/nonexistent"))
if _path.exists():
    globals().update(build_dags_from_yaml(_path))
