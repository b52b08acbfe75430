"""Deprecated: ``airflow_retention.core.planner`` moved to ``airflow_retention.core.planning.planner`` in 0.2.0;
import the stable names from ``airflow_retention.core``. Every name it had is forwarded with a warning until 0.3.0."""

from airflow_retention.core.moved import forwarding

__getattr__ = forwarding(
    __name__,
    (
        "airflow_retention.core.planning.planner",
        "airflow_retention.core.planning.plans",
        "airflow_retention.core.planning.sizing",
        "airflow_retention.core.planning.probes",
        "airflow_retention.core.planning.tenants",
        "airflow_retention.core.planning.walkers.keys",
        "airflow_retention.core.planning.walkers.blocks",
        "airflow_retention.core.planning.walkers.spans",
    ),
)
