"""The browser and HTTP tests' auth manager: Airflow's SimpleAuthManager, with users whose DAGs are limited.

``$RETENTION_TEST_DAG_GRANTS`` maps a user name to the DAG ids that user may read (JSON, e.g.
``{"limited": ["retention_unreachable"], "outsider": []}``). A user it names may read those DAGs, nothing
else of any DAG (not "all DAGs"), and no connection; every other user is as SimpleAuthManager makes them
(``admin`` may do everything). The api-server imports this module (``[core] auth_manager``), so it must
not import pytest or the tests' helpers.

Only ``is_authorized_dag`` and ``is_authorized_connection`` are overridden: Airflow's own
``get_authorized_dag_ids`` (read the DAGs, and their teams, from the metadata database) and
``filter_authorized_dag_ids`` ask ``is_authorized_dag`` of each DAG, so all three agree, and the view is
tested through the auth manager's real DAG filter.
"""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

GRANTS_ENV = "RETENTION_TEST_DAG_GRANTS"


def grants() -> dict[str, frozenset[str]]:
    return {user: frozenset(dags) for user, dags in json.loads(os.environ.get(GRANTS_ENV) or "{}").items()}


class LimitedAuthManager(SimpleAuthManager):
    """SimpleAuthManager with the DAG grants of ``$RETENTION_TEST_DAG_GRANTS``."""

    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        limited = grants().get(user.get_name())
        if limited is None:
            return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
        dag_id = getattr(details, "id", None)
        return method == "GET" and dag_id is not None and dag_id in limited

    def is_authorized_connection(self, *, method: Any, user: Any, details: Any = None) -> bool:
        if user.get_name() in grants():
            return False
        return super().is_authorized_connection(method=method, user=user, details=details)
