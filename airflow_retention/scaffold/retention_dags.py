"""One retention DAG per policy in ``retention_policies.yaml`` beside this file.

Set ``AIRFLOW_RETENTION_POLICIES`` to read another file. A policy with a mistake becomes a DAG of its own,
``retention_<name>``, tagged ``invalid``, whose description names the policy and the field and whose one task
fails at once; the other policies' DAGs load and run as usual. The file never raises: an import error would
make Airflow's dag-processor drop every DAG of the file, the good policies' too.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_retention.dag_factory import build_dags_from_yaml

POLICIES = Path(os.environ.get("AIRFLOW_RETENTION_POLICIES") or Path(__file__).with_name("retention_policies.yaml"))

globals().update(build_dags_from_yaml(POLICIES))
