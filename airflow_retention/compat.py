"""The few Airflow names that moved between Airflow 3.0 and 3.3, each with its fallback.

Before Airflow 3.2 (``apache-airflow-task-sdk`` 1.0 and 1.1) the Task SDK does not export ``conf``
from ``airflow.sdk``, has no ``AirflowFailException``/``AirflowSensorTimeout`` in
``airflow.sdk.exceptions`` and no ``airflow.sdk.observability``; there the same objects live in
``airflow.configuration``, ``airflow.exceptions`` and ``airflow.stats`` (what the task runner of those
versions itself catches and uses). Newer Airflow is tried first, so nothing changes on it. The rest of
the package imports these names from here and from ``airflow.sdk`` only.
"""

from __future__ import annotations

from typing import Any

try:  # Airflow 3.2+ (Task SDK 1.2+)
    from airflow.sdk import conf
except ImportError:  # Airflow 3.0, 3.1
    from airflow.configuration import conf  # type: ignore[no-redef]

try:  # Airflow 3.2+
    from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout
except ImportError:  # Airflow 3.0, 3.1: the classes their task runner catches
    from airflow.exceptions import AirflowFailException, AirflowSensorTimeout  # type: ignore[no-redef]

try:  # Airflow 3.2+
    from airflow.sdk.observability import stats
except ImportError:  # Airflow 3.0, 3.1: the same incr/gauge/timing API on Airflow's Stats
    from airflow.stats import Stats as stats  # type: ignore[no-redef]

from airflow.sdk import __version__ as _task_sdk_version

# Task SDK 1.2 (Airflow 3.2) made an operator's ``retry_exponential_backoff`` a multiplier (a float; True
# would be 1, a constant delay); before, it is a switch, and True doubles the delay at each try. Both
# values below mean "double the retry delay at each try, up to max_retry_delay".
RETRY_EXPONENTIAL_BACKOFF: float | bool = (
    2.0 if tuple(int(n) for n in _task_sdk_version.split(".")[:2]) >= (1, 2) else True
)

__all__ = [
    "RETRY_EXPONENTIAL_BACKOFF",
    "AirflowFailException",
    "AirflowSensorTimeout",
    "conf",
    "dagbag",
    "stats",
]


def dagbag(dag_folder: str) -> Any:
    """Airflow's ``DagBag`` of a folder, as the demo and the tests load their DAGs: in
    ``airflow.dag_processing.dagbag`` from Airflow 3.2, in ``airflow.models.dagbag`` before."""
    try:
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # Airflow 3.0, 3.1
        from airflow.models.dagbag import DagBag  # type: ignore[no-redef]
    return DagBag(dag_folder)
