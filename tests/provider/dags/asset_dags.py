"""Test DAGs of issue 33 (lineage, assets, deadlines): a policy whose DAG updates its table's asset, a report
DAG scheduled on that asset, and a policy with a cleanup window (a deadline alert on Airflow 3.1+); run by
tests/provider/test_assets_deadlines.py and test_lineage.py. The asset's URI is made from the connection
``retention_target`` when this file is parsed: the tests' database on the tests' server."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from airflow.sdk import DAG, task

from airflow_retention.assets import policy_asset
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.dag_factory import build_dags

AUDIT_ASSET = RetentionPolicy(
    name="t_audit_asset",
    conn_id="retention_target",
    table="airflow_t.audit",
    key_column="id",
    timestamp_column="at",
    retention="10 days",
    ledger_schema="airflow_t_ledger",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    retries=0,
    asset=True,
)
# Not run by dag.test(): Airflow 3.3.2's dag.test() fails at the end of a DAG with a deadline alert
# (apache/airflow#73428); the test creates its run as the scheduler does.
AUDIT_DEADLINE = dataclasses.replace(AUDIT_ASSET, name="t_audit_deadline", asset=None, cleanup_window="24h")

globals().update(build_dags([AUDIT_ASSET, AUDIT_DEADLINE]))

with DAG(
    dag_id="t_report_after_purge",
    schedule=[policy_asset(AUDIT_ASSET)],
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    is_paused_upon_creation=False,  # queued by the asset event at once (a new DAG is paused by default)
    catchup=False,
):

    @task
    def report(triggering_asset_events=None) -> list:
        return [event.extra for events in (triggering_asset_events or {}).values() for event in events]

    report()
