"""Provider metadata read by Airflow's providers manager through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    from airflow_retention import __version__

    return {
        "package-name": "airflow-retention",
        "name": "Retention",
        "description": "Scheduled, bounded, idempotent deletion of expired PostgreSQL rows, with a chunk ledger.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Retention",
                "external-doc-url": "https://pypi.org/project/airflow-retention/",
                "tags": ["software"],
            }
        ],
        "operators": [{"integration-name": "Retention", "python-modules": ["airflow_retention.operators.retention"]}],
        "sensors": [{"integration-name": "Retention", "python-modules": ["airflow_retention.sensors.retention"]}],
        "hooks": [{"integration-name": "Retention", "python-modules": ["airflow_retention.hooks.retention"]}],
        "triggers": [{"integration-name": "Retention", "python-modules": ["airflow_retention.triggers.retention"]}],
    }
