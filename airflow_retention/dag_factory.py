"""Build retention DAGs and task groups from policies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, TaskGroup

from airflow_retention.compat import RETRY_EXPONENTIAL_BACKOFF
from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy import DAG_ID_PREFIX, RetentionPolicy, load_policies_lenient
from airflow_retention.operators.retention import (
    CHUNK_LABEL_TEMPLATE,
    RetentionChunkOperator,
    RetentionPlanOperator,
    RetentionVacuumOperator,
)
from airflow_retention.sensors.retention import RetentionCompleteSensor


def task_defaults(policy: RetentionPolicy) -> dict[str, Any]:
    """Retries with exponential backoff (a retry is a redelivery, and the ledger makes it harmless), and
    the policy's queue for every task."""
    defaults: dict[str, Any] = {
        "retries": policy.retries,
        "retry_delay": timedelta(milliseconds=policy.retry_delay_ms),
        "retry_exponential_backoff": RETRY_EXPONENTIAL_BACKOFF,
        "max_retry_delay": timedelta(minutes=10),
    }
    if policy.queue:
        defaults["queue"] = policy.queue
    return defaults


def retention_task_group(
    policy: RetentionPolicy,
    *,
    group_id: str | None = None,
    max_chunks: int | None = None,
    deferrable: bool = False,
    sensor_kwargs: Mapping[str, Any] | None = None,
    chunk_kwargs: Mapping[str, Any] | None = None,
) -> TaskGroup:
    """plan → purge chunks (mapped) → verify (→ vacuum, with ``vacuum_after_rows``), as a TaskGroup to
    drop into any DAG.

    Call it inside a ``with DAG(...)`` block. Chunk tasks run in the policy's pool with at most
    ``max_active_chunks`` at once per run; the verify task runs whatever the chunks' outcome.

    :param policy: the retention policy.
    :param group_id: the group's id; default ``retention_<policy name>``.
    :param max_chunks: at most this many chunks (never more than ``[core] max_map_length``).
    :param deferrable: let the verify sensor wait in the triggerer.
    :param sensor_kwargs: extra arguments of the verify sensor (``poke_interval``, ``timeout``...).
    :param chunk_kwargs: extra arguments of the chunk tasks (``queue``, ``execution_timeout``...).
    """
    defaults = task_defaults(policy)
    with TaskGroup(group_id or f"{DAG_ID_PREFIX}{policy.name}", tooltip=f"retention policy {policy.name}") as group:
        plan = RetentionPlanOperator(task_id="plan", policy=policy, max_chunks=max_chunks, **defaults)
        chunk_args: dict[str, Any] = {
            **defaults,
            "max_active_tis_per_dagrun": policy.max_active_chunks,
            "map_index_template": CHUNK_LABEL_TEMPLATE,
        }
        if policy.pool:
            chunk_args["pool"] = policy.pool
        chunk_args.update(chunk_kwargs or {})
        chunks = RetentionChunkOperator.partial(
            task_id="purge_chunk", policy=policy, from_plan=True, **chunk_args
        ).expand_kwargs(plan.output)
        verify = RetentionCompleteSensor(
            task_id="verify",
            policy=policy,
            plan_task_id=plan.task_id,
            chunk_task_id=chunks.task_id,
            deferrable=deferrable,
            **{**defaults, **(sensor_kwargs or {})},
        )
        plan >> chunks >> verify
        if policy.vacuum_after_rows is not None:
            verify >> RetentionVacuumOperator(task_id="vacuum", policy=policy, plan_task_id=plan.task_id, **defaults)
    return group


def build_dag(policy: RetentionPolicy, *, dag_id: str | None = None, **group_kwargs: Any) -> DAG:
    """One DAG for one policy: its schedule, ``max_active_runs=1`` (two runs never purge one table at
    once), catchup off unless the policy says so, retries with backoff, and the policy as ``doc_md``."""
    with DAG(
        dag_id=dag_id or f"{DAG_ID_PREFIX}{policy.name}",
        schedule=policy.schedule,
        start_date=policy.start_date,
        catchup=policy.catchup,
        max_active_runs=1,
        default_args=task_defaults(policy),
        tags=["retention", *policy.tags],
        doc_md=policy.describe(),
        description=f"Delete rows of {policy.table} older than {policy.retention}",
    ) as dag:
        retention_task_group(policy, **group_kwargs)
    return dag


class _InvalidPoliciesDag(DAG):
    """Stands in for the DAGs of invalid policies: Airflow validates every DAG of a file separately and
    records a failing one as an import error of the file while the file's other DAGs still load."""

    def validate(self) -> None:
        raise PolicyError(None, None, self.doc_md or "invalid retention policy")


def build_dags(policies: Iterable[RetentionPolicy], errors: Iterable[PolicyError] = ()) -> dict[str, DAG]:
    """DAGs keyed by id, for a DAG file's ``globals().update(...)``; invalid policies become one import
    error that names each policy and field."""
    dags = {}
    problems = [str(e) for e in errors]
    for policy in policies:
        try:
            dag = build_dag(policy)
            dag.validate()  # an invalid cron schedule is only found here
        except Exception as exc:  # noqa: BLE001 - report it with the policy's name, keep the other DAGs
            problems.append(str(PolicyError(policy.name, None, f"cannot build its DAG: {exc}")))
            continue
        dags[dag.dag_id] = dag
    if problems:
        bad = _InvalidPoliciesDag(
            dag_id=f"{DAG_ID_PREFIX}invalid_policies",
            schedule=None,
            doc_md="; ".join(problems),
        )
        dags[bad.dag_id] = bad
    return dags


def build_dags_from_yaml(path: str | Path) -> dict[str, DAG]:
    """Every policy of a YAML file as a DAG; bad policies are reported as an import error."""
    policies, errors = load_policies_lenient(path)
    return build_dags(policies, errors)
