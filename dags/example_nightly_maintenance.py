"""An unrelated nightly pipeline that reuses airflow-retention's pieces between tasks of its own:
the retention task group of the ``audit_log`` policy, then a lone chunk of ``webhook_deliveries``.

It reads the same policies file as ``retention_dags.py`` (``AIRFLOW_RETENTION_POLICIES`` or the YAML
beside this file) and is only built when both policies are in it.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from airflow.sdk import DAG, task

from airflow_retention import load_policies
from airflow_retention.dag_factory import retention_task_group
from airflow_retention.operators.retention import RetentionChunkOperator

POLICIES = Path(os.environ.get("AIRFLOW_RETENTION_POLICIES") or Path(__file__).with_name("retention_policies.yaml"))
policies = {p.name: p for p in load_policies(POLICIES)}

if {"audit_log", "webhook_deliveries"} <= set(policies):
    with DAG(
        dag_id="example_nightly_maintenance",
        schedule=None,
        start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
        catchup=False,
        tags=["example", "retention"],
        doc_md=__doc__,
    ):

        @task
        def export_daily_report() -> str:
            return "report exported"

        @task
        def notify(purge: dict) -> str:
            return f"webhook purge: {purge['rows_deleted']} row(s) in {purge['batches']} batch(es)"

        audit = retention_task_group(policies["audit_log"], group_id="purge_audit_log")
        # A lone chunk with a ledger run of its own ("...#lone"): the whole table, as a range of its blocks
        # (it stops at the table's last block).
        webhooks = RetentionChunkOperator(
            task_id="purge_old_webhooks",
            policy=policies["webhook_deliveries"],
            blocks=(0, 2**62),
        )
        export_daily_report() >> audit >> webhooks
        notify(webhooks.output)
