"""A policy's ``cleanup_window`` as an Airflow deadline alert: a run not complete that long after its date
(the DAG run's logical date) is late, and the alert's callback says so.

Deadline alerts exist from Airflow 3.1 (``airflow.sdk.definitions.deadline``); they are found by feature,
not by version (:data:`DEADLINES_SUPPORTED`). The default callback, :func:`log_missed_deadline`, runs in
the triggerer: an ERROR line in the triggerer's log and the metric ``retention.deadlines_missed.<policy>``.
Pass your own (a notifier, say) to ``build_dag``/``build_dags``/``build_dags_from_yaml`` as
``deadline_callback``. On Airflow 3.0 the window is not enforced: building the DAG logs a warning once per
policy, and the cleanup lag (``airflow-retention status``, the metric ``retention.cleanup_lag_seconds``)
is what shows a purge falling behind (docs/lineage.md).
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from typing import Any

from airflow_retention.compat import stats
from airflow_retention.core.policy.durations import format_window
from airflow_retention.core.policy.model import RetentionPolicy

try:  # Airflow 3.1+
    from airflow.sdk.definitions.deadline import AsyncCallback, Callback, DeadlineAlert, DeadlineReference
except ImportError:  # Airflow 3.0: no deadline alerts
    AsyncCallback = Callback = DeadlineAlert = DeadlineReference = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

#: Whether this Airflow has deadline alerts (3.1+): ``DAG(deadline=DeadlineAlert(...))``.
DEADLINES_SUPPORTED = DeadlineAlert is not None
#: The default callback, by the dotted path Airflow stores and imports in the triggerer.
DEFAULT_CALLBACK = "airflow_retention.deadlines.log_missed_deadline"
_warned: set[str] = set()


async def log_missed_deadline(
    *,
    policy: str | None = None,
    table: str | None = None,
    cleanup_window: str | None = None,
    context: dict[str, Any] | None = None,
) -> str:
    """The default deadline callback: one ERROR line naming the policy, the run and its deadline, and the
    metric ``retention.deadlines_missed.<policy>``. Airflow awaits it in the triggerer when a run of the
    policy's DAG is not complete ``cleanup_window`` after its logical date, with the run in ``context``.
    The keyword arguments are those :func:`cleanup_deadline` gives; without them the line names the DAG."""
    run = (context or {}).get("dag_run") or {}
    deadline = (context or {}).get("deadline") or {}
    policy = policy or str(run.get("dag_id"))
    late = f"is not complete {cleanup_window} after its date (cleanup_window)" if cleanup_window else "is late"
    message = (
        f"retention policy {policy}{f' ({table})' if table else ''}: DAG run"
        f" {run.get('run_id') or run.get('dag_run_id')!s} of {run.get('dag_id')!s} (logical date"
        f" {run.get('logical_date')!s}, {run.get('run_type') or 'a'} run, state {run.get('state')!s}) {late}:"
        f" its deadline {deadline.get('deadline_time')!s} passed"
    )
    log.error("%s", message)
    try:
        stats.incr(f"retention.deadlines_missed.{policy}", 1, tags={"policy": policy, "table": table or ""})
    except Exception:  # a metrics backend that fails must not hide the line above
        log.debug("could not send the deadline metric", exc_info=True)
    return message


def cleanup_deadline(policy: RetentionPolicy, callback: Any = None) -> Any:
    """The deadline alert of a policy's ``cleanup_window``: the run's logical date plus the window, then
    ``callback``. None when the policy has no window.

    :param callback: an ``AsyncCallback`` or ``SyncCallback`` of Airflow's, used as given; or an awaitable
        callable (a notifier class, an ``async def``) or its dotted path, wrapped in an ``AsyncCallback``
        without arguments. Default: :func:`log_missed_deadline` with the policy's name, table and window.
    :raises RuntimeError: on an Airflow without deadline alerts (3.0); check :data:`DEADLINES_SUPPORTED`.
    """
    if policy.cleanup_window is None:
        return None
    if not DEADLINES_SUPPORTED:
        raise RuntimeError("deadline alerts need Airflow 3.1 or later")
    if callback is None:
        callback = AsyncCallback(
            DEFAULT_CALLBACK,
            kwargs={
                "policy": policy.name,
                "table": str(policy.table),
                "cleanup_window": format_window(policy.cleanup_window),
            },
        )
    elif not isinstance(callback, Callback):
        callback = AsyncCallback(callback)
    kwargs: dict[str, Any] = {}
    if "name" in inspect.signature(DeadlineAlert).parameters:  # Airflow 3.2+: shown with the deadline
        kwargs["name"] = f"cleanup_window of {policy.name}"
    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
        interval=timedelta(seconds=policy.cleanup_window.total_seconds()),
        callback=callback,
        **kwargs,
    )


def deadline_kwargs(policy: RetentionPolicy, *, deadline: Any = None, callback: Any = None) -> dict[str, Any]:
    """The ``DAG(...)`` arguments of a policy's deadline: ``deadline`` as given (a ``DeadlineAlert`` or a
    list), else the policy's :func:`cleanup_deadline`; nothing without either. On Airflow 3.0 a policy's
    window yields nothing and a warning, once per policy and process; an explicit ``deadline`` is refused.
    """
    if deadline is not None:
        if not DEADLINES_SUPPORTED:
            raise ValueError(f"policy {policy.name!r}: deadline= needs Airflow 3.1 or later (deadline alerts)")
        return {"deadline": deadline}
    if policy.cleanup_window is None:
        return {}
    if not DEADLINES_SUPPORTED:
        if policy.name not in _warned:
            _warned.add(policy.name)
            log.warning(
                "policy %s: cleanup_window %s is not enforced on this Airflow: deadline alerts need Airflow 3.1"
                " or later. Watch the cleanup lag instead (airflow-retention status, metric"
                " retention.cleanup_lag_seconds.%s)",
                policy.name,
                format_window(policy.cleanup_window),
                policy.name,
            )
        return {}
    return {"deadline": cleanup_deadline(policy, callback)}
