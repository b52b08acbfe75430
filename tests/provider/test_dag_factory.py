"""The DAG a policy becomes: its shape and settings."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_retention.core.policy.model import RetentionPolicy

pytestmark = pytest.mark.airflow

POLICY = RetentionPolicy(
    name="shape",
    conn_id="retention_target",
    table="public.things",
    key_column="id",
    timestamp_column="created_at",
    retention="30 days",
    pool="retention_pool",
    max_active_chunks=3,
    retries=5,
    tags=("team-a",),
)


def test_one_dag_per_policy_with_safe_defaults() -> None:
    from airflow_retention.dag_factory import build_dag
    from airflow_retention.operators.retention import CHUNK_LABEL_TEMPLATE

    dag = build_dag(POLICY)
    assert dag.dag_id == "retention_shape"
    assert dag.max_active_runs == 1
    assert dag.catchup is False
    assert "retention" in dag.tags and "team-a" in dag.tags
    assert "30 days" in dag.doc_md and "cutoff" in dag.doc_md.lower()
    plan = dag.task_dict["retention_shape.plan"]
    chunks = dag.task_dict["retention_shape.purge_chunk"]
    verify = dag.task_dict["retention_shape.verify"]
    assert plan.retries == 5 and plan.retry_exponential_backoff
    assert plan.max_retry_delay == timedelta(minutes=10)
    assert chunks.pool == "retention_pool"
    assert chunks.max_active_tis_per_dagrun == 3
    assert chunks.map_index_template == CHUNK_LABEL_TEMPLATE
    # verify runs after every chunk ended, even when none was planned (the empty mapped task is skipped)
    assert verify.trigger_rule == "all_done"
    assert verify.mode == "reschedule"
    assert verify.poke_interval == 5  # only a chunk that may still be written is waited for
    assert verify.upstream_task_ids == {"retention_shape.purge_chunk", "retention_shape.plan"} or (
        verify.upstream_task_ids == {"retention_shape.purge_chunk"}
    )
    assert chunks.upstream_task_ids == {"retention_shape.plan"}


def test_task_group_drops_into_any_dag() -> None:
    from airflow.sdk import DAG

    from airflow_retention.dag_factory import retention_task_group

    with DAG(dag_id="host", schedule=None) as dag:
        group = retention_task_group(POLICY, group_id="cleanup", max_chunks=10)
    assert group.group_id == "cleanup"
    assert {"cleanup.plan", "cleanup.purge_chunk", "cleanup.verify"} == set(dag.task_dict)
    assert dag.task_dict["cleanup.plan"].max_chunks == 10


def test_chunk_label_reads_well() -> None:
    from airflow_retention.operators.retention import RetentionChunkOperator

    op = RetentionChunkOperator(task_id="c", policy=POLICY, keys=(120000, 130000), tenants=[7])
    assert op.chunk_label == "tenant 7 · ids [120000, 130000)"
    assert RetentionChunkOperator(task_id="d", policy=POLICY, keys=(1, 25655)).chunk_label == "ids [1, 25655)"


def test_the_label_template_shows_the_result_once_known_else_the_range() -> None:
    """Rendered as Airflow renders ``map_index_template``: with the task's DAG's Jinja environment (strict
    about undefined names) and the context, before execute and again after it."""
    from airflow.sdk import DAG

    from airflow_retention.operators.retention import CHUNK_LABEL_TEMPLATE, RetentionChunkOperator

    with DAG(dag_id="labels", schedule=None) as dag:
        op = RetentionChunkOperator(task_id="c", policy=POLICY, blocks=(0, 8192))
    template = dag.get_template_env().from_string(CHUNK_LABEL_TEMPLATE)
    assert op.map_index_template == CHUNK_LABEL_TEMPLATE
    assert template.render({"task": op}) == "blocks [0, 8192)"  # before execute, or after a failure
    context = {"task": op, "chunk_label": "blocks [0, 8192) · 12,067 deleted"}  # what execute leaves
    assert template.render(context) == "blocks [0, 8192) · 12,067 deleted"


def test_a_chunks_result_in_a_few_words() -> None:
    from airflow_retention.core.running.engine import ChunkResult
    from airflow_retention.operators.retention import outcome_text

    assert outcome_text(ChunkResult("r", "c", rows_deleted=12067), dry_run=False) == "12,067 deleted"
    assert outcome_text(ChunkResult("r", "c", rows_matched=5), dry_run=True) == "5 would be deleted"
    assert outcome_text(ChunkResult("r", "c", already_complete=True), dry_run=False) == "already complete"
    archived = ChunkResult("r", "c", rows_deleted=3, rows_archived=3)
    assert outcome_text(archived, dry_run=False) == "3 deleted, 3 archived"
    assert outcome_text(ChunkResult("r", "c", rows_deleted=40, outcome="detached"), dry_run=False) == "40 detached"
