"""Build retention DAGs and task groups from policies."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, BaseOperator, TaskGroup

from airflow_retention.assets import RunEventExtra, policy_asset
from airflow_retention.compat import RETRY_EXPONENTIAL_BACKOFF, AirflowFailException
from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.loading import load_policies_lenient, problem_dag_ids
from airflow_retention.core.policy.model import DAG_ID_PREFIX, RetentionPolicy, policy_dag_id
from airflow_retention.deadlines import deadline_kwargs
from airflow_retention.operators.retention import (
    CHUNK_LABEL_TEMPLATE,
    RetentionChunkOperator,
    RetentionPlanOperator,
    RetentionVacuumOperator,
)
from airflow_retention.sensors.retention import RetentionCompleteSensor

log = logging.getLogger(__name__)


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
    ``max_active_chunks`` at once per run; the verify task runs whatever the chunks' outcome. With the
    policy's ``asset``, the verify task has the table's asset as an outlet and, when it marks the run
    complete, sets the asset event's extra to the run's totals (:class:`~airflow_retention.assets.RunEventExtra`).

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
            **_with_asset(policy, {**defaults, **(sensor_kwargs or {})}),
        )
        plan >> chunks >> verify
        if policy.vacuum_after_rows is not None:
            verify >> RetentionVacuumOperator(task_id="vacuum", policy=policy, plan_task_id=plan.task_id, **defaults)
    return group


def _with_asset(policy: RetentionPolicy, sensor_args: dict[str, Any]) -> dict[str, Any]:
    """The verify sensor's arguments, with the policy's asset as an outlet (beside any of the caller's) and
    the hook that sets its event's extra (after any ``post_execute`` of the caller's)."""
    if policy.asset is None:
        return sensor_args
    asset = policy_asset(policy)
    outlets = sensor_args.get("outlets") or []
    outlets = list(outlets) if isinstance(outlets, (list, tuple)) else [outlets]
    return {
        **sensor_args,
        "outlets": [*outlets, asset],
        "post_execute": RunEventExtra(asset, policy, sensor_args.get("post_execute")),
    }


def build_dag(
    policy: RetentionPolicy,
    *,
    dag_id: str | None = None,
    deadline: Any = None,
    deadline_callback: Any = None,
    **group_kwargs: Any,
) -> DAG:
    """One DAG for one policy: its schedule, ``max_active_runs=1`` (no second scheduled or manual run while
    one runs; a backfill's runs are counted apart and may run beside it, which stays correct: every row is
    deleted and counted once, docs/concepts.md), catchup off unless the policy says so, retries with
    backoff, and the policy as ``doc_md``.

    With the policy's ``cleanup_window``, on Airflow 3.1+, the DAG has a deadline alert: a run not complete
    that long after its logical date calls ``deadline_callback`` (default: an ERROR line in the triggerer's
    log and a metric; :mod:`airflow_retention.deadlines`). ``deadline`` (a ``DeadlineAlert`` or a list)
    replaces it. On Airflow 3.0 the window only logs a warning.
    """
    with DAG(
        dag_id=dag_id or policy_dag_id(policy),
        schedule=policy.schedule,
        start_date=policy.start_date,
        catchup=policy.catchup,
        max_active_runs=1,
        default_args=task_defaults(policy),
        tags=["retention", *policy.tags],
        doc_md=policy.describe(),
        description=f"Delete rows of {policy.table} older than {policy.retention}",
        **deadline_kwargs(policy, deadline=deadline, callback=deadline_callback),
    ) as dag:
        retention_task_group(policy, **group_kwargs)
    return dag


# The DAG of an unreadable policies file, and of the entries that cannot be named by a DAG id of their own.
INVALID_TAGS = ["retention", "invalid"]


class InvalidPolicyOperator(BaseOperator):
    """The one task of an invalid policy's DAG: fails at once, never retried, with the policy's error."""

    ui_color = "#f4a6a6"

    def __init__(self, *, message: str, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "retries": 0})
        self.message = message

    def execute(self, context: Any) -> None:
        raise AirflowFailException(self.message)


def invalid_policy_dag(dag_id: str, messages: list[str]) -> DAG:
    """A DAG that stands for invalid policies: no schedule, tags ``retention`` and ``invalid``, the errors
    as its description and doc, and one task that fails at once with them.

    Why a DAG and not an import error: Airflow 3's dag-processor marks every DAG of a file with an import
    error stale, so one typo would stop every policy of the file. This DAG keeps the file importable,
    shows the error where an operator looks (the Dags page, the DAG's doc, the REST API), and makes any
    trigger of it fail with the error; the policy's own DAG comes back under the same id once it is fixed.
    """
    message = "; ".join(messages)
    doc = "\n".join(f"    {line}" for line in "\n\n".join(messages).splitlines())
    with DAG(
        dag_id=dag_id,
        schedule=None,
        catchup=False,
        max_active_runs=1,
        tags=INVALID_TAGS,
        description=f"Retention policy error: {message}",
        doc_md=(
            "**Invalid retention policy: nothing is deleted for it until the policies file is fixed.**\n\n"
            f"{doc}\n\n"
            "The dag-processor re-reads the file at its next parse; this DAG then becomes the policy's own DAG "
            "again. Triggering this DAG fails at once with the error above."
        ),
    ) as dag:
        InvalidPolicyOperator(task_id="policy_error", message=message)
    return dag


def build_dags(
    policies: Iterable[RetentionPolicy], errors: Iterable[PolicyError] = (), *, deadline_callback: Any = None
) -> dict[str, DAG]:
    """DAGs keyed by id, for a DAG file's ``globals().update(...)``.

    Each invalid policy becomes a DAG of its own under its usual id ``retention_<name>``
    (:func:`invalid_policy_dag`), whose task fails at once with the error naming the policy and the field;
    errors without a usable name (an unreadable file, an entry that is not a mapping or has no valid name,
    a second policy of one name) share ``retention_invalid_policies``. Nothing here raises: a DAG file never
    becomes an import error, which would stop the valid policies too. Each error is also logged as a
    warning, in the dag-processor's log. ``deadline_callback`` is the callback of every policy's
    ``cleanup_window`` deadline (see :func:`build_dag`).
    """
    dags: dict[str, DAG] = {}
    problems: list[PolicyError] = list(errors)
    for policy in policies:
        try:
            dag = build_dag(policy, deadline_callback=deadline_callback)
            dag.validate()  # an invalid cron schedule is only found here
        except Exception as exc:  # noqa: BLE001 - report it with the policy's name, keep the other DAGs
            problems.append(PolicyError(policy.name, None, f"cannot build its DAG: {exc}"))
            continue
        dags[dag.dag_id] = dag
    for problem in problems:
        log.warning("invalid retention policy: %s", problem)
    built = [dag_id.removeprefix(DAG_ID_PREFIX) for dag_id in dags]
    bad = problem_dag_ids(built, problems)
    for dag_id, messages in bad.items():
        dags[dag_id] = invalid_policy_dag(dag_id, messages)
    return dags


def build_dags_from_yaml(path: str | Path, *, deadline_callback: Any = None) -> dict[str, DAG]:
    """Every policy of a YAML file as a DAG; each bad policy becomes a DAG that shows its error (see
    :func:`build_dags`). A file that cannot be read at all has no good policy: it becomes the one DAG
    ``retention_invalid_policies`` with the reason, still no import error. ``deadline_callback``: see
    :func:`build_dag`."""
    try:
        policies, errors = load_policies_lenient(path)
    except PolicyError as exc:
        return build_dags([], [exc])
    return build_dags(policies, errors, deadline_callback=deadline_callback)
