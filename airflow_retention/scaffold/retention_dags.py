"""One retention DAG per policy in ``retention_policies.yaml`` beside this file.

Set ``AIRFLOW_RETENTION_POLICIES`` to read another file. A policy with a mistake becomes an import error
naming the policy and the field; the other policies' DAGs still load.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_retention.dag_factory import build_dags_from_yaml

POLICIES = Path(os.environ.get("AIRFLOW_RETENTION_POLICIES") or Path(__file__).with_name("retention_policies.yaml"))

globals().update(build_dags_from_yaml(POLICIES))
