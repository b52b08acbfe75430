"""Deprecated: ``airflow_retention.core.verify`` moved to ``airflow_retention.core.running.verify`` in 0.2.0;
import the stable names from ``airflow_retention.core``. Every name it had is forwarded with a warning until 0.3.0."""

from airflow_retention.core.moved import forwarding

__getattr__ = forwarding(__name__, ("airflow_retention.core.running.verify",))
