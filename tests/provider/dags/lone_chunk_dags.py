"""Lone chunks whose range starts past the table's end (tests/provider/test_lone_chunk.py), and a run
dated at a month end whose tenant keeps 7 days."""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG

from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.dag_factory import retention_task_group
from airflow_retention.operators.retention import RetentionChunkOperator

AUDIT = RetentionPolicy(
    name="audit_log",
    conn_id="retention_target",
    table="audit.audit_log",
    key_column="id",
    timestamp_column="logged_at",
    retention="1 year",
    retries=0,
)
MONTH_END = RetentionPolicy(
    name="t_month_end",
    conn_id="retention_target",
    table="airflow_t.orders",
    key_column="id",
    timestamp_column="created_at",
    tenant_column="tenant_id",
    tenant_retention={2: "7 days"},
    retention="1 month",
    chunk_rows=20_000,
    retries=0,
    ledger_schema="airflow_t_ledger",
)
START = datetime(2026, 1, 1, tzinfo=timezone.utc)

for dag_id, kwargs in (
    ("lone_blocks_past_the_end", {"blocks": (10_000, 30_000)}),
    ("lone_keys_past_the_end", {"keys": (5_000_000, 6_000_000)}),
):
    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False, tags=["test"]):
        RetentionChunkOperator(task_id="lone", policy=AUDIT, cutoff="2025-06-01T00:00:00Z", retries=0, **kwargs)

with DAG(dag_id="month_end", schedule=None, start_date=START, catchup=False, tags=["test"]):
    retention_task_group(MONTH_END, sensor_kwargs={"poke_interval": 1, "timeout": 60, "retries": 0})
