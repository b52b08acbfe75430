"""airflow-retention: scheduled, bounded, idempotent deletion of expired PostgreSQL rows for Airflow 3."""

from __future__ import annotations

# Semantic versioning; every release has its section in CHANGELOG.md.
__version__ = "0.2.0"

from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy

__all__ = ["RetentionPolicy", "__version__", "load_policies"]
