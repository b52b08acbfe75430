"""An unrelated pipeline that embeds the retention task group (with the deferrable sensor) and a lone
RetentionChunkOperator between tasks of its own."""

from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG, task

from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.dag_factory import retention_task_group
from airflow_retention.operators.retention import RetentionChunkOperator

POLICY = RetentionPolicy(
    name="reuse_orders",
    conn_id="retention_target",
    table="airflow_t.orders",
    key_column="id",
    timestamp_column="created_at",
    tenant_column="tenant_id",
    condition="status <> 'open'",
    retention="10 days",
    batch_size=500,
    chunk_rows=4000,
    retries=0,
    ledger_schema="airflow_t_ledger",
)
LONE = RetentionPolicy(
    name="reuse_audit",
    conn_id="retention_target",
    table="airflow_t.audit",
    key_column="id",
    timestamp_column="at",
    retention="1 day",
    batch_size=100,
    retries=0,
    ledger_schema="airflow_t_ledger",
)

with DAG(
    dag_id="reuse_pipeline",
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    tags=["test"],
) as dag:

    @task
    def extract() -> int:
        return 1

    # One XCom for the whole dict: Airflow 3.0 cannot push the None values of a multiple_outputs dict.
    @task(multiple_outputs=False)
    def report(summary: dict) -> dict:
        if summary["rows_deleted"] < 0:
            raise ValueError(summary)
        return summary

    group = retention_task_group(
        POLICY, deferrable=True, sensor_kwargs={"poke_interval": 1, "timeout": 60, "retries": 0}
    )
    lone = RetentionChunkOperator(task_id="lone_chunk", policy=LONE, keys=(0, 1_000_000))
    extract() >> group >> lone
    report(lone.output)
