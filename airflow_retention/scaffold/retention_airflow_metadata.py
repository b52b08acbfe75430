"""Airflow's own metadata database, purged like ``airflow db clean`` would purge it, in bounded batches
with a ledger: one DAG, ``retention_airflow_metadata``, built from ``retention_airflow_metadata.yaml``
beside this file and from the cleanup configuration of the Airflow that parses it (docs/airflow-metadata.md).

Set ``AIRFLOW_RETENTION_METADATA`` to read another file. A mistake in the file makes the DAG fail at once
with the error; the file never raises.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_retention.metadata import metadata_dag_from_yaml

SETTINGS = Path(
    os.environ.get("AIRFLOW_RETENTION_METADATA") or Path(__file__).with_name("retention_airflow_metadata.yaml")
)

globals().update(metadata_dag_from_yaml(SETTINGS))
