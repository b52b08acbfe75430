"""The Airflow plugin of the Retention view, registered by the package's ``airflow.plugins`` entry point.

Airflow 3.1+: the FastAPI app is mounted at ``/retention`` and a navigation entry (Browse → Retention) opens
it inside the UI (an external view with a ``url_route``: the UI frames it at ``/plugin/retention``).
Airflow 3.0: the app is mounted, but 3.0 has no external views, so there is no menu entry; and its UI keeps
the session token in the browser's local storage rather than in a cookie, so the pages answer only requests
with an ``Authorization: Bearer`` token (docs/ui.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.plugins_manager import AirflowPlugin

from airflow_retention.plugins.app import MOUNT, create_app

NAME = "Retention"


class RetentionViewPlugin(AirflowPlugin):
    """The Retention view: per policy, the last runs, rows deleted and cleanup lag, chunks and missed days."""

    name = "retention"
    fastapi_apps: ClassVar[list[Any]] = [{"app": create_app(), "url_prefix": MOUNT, "name": NAME}]
    external_views: ClassVar[list[Any]] = [
        {
            "name": NAME,
            # Relative, without a leading slash: the UI resolves it against its base URL.
            "href": f"{MOUNT.lstrip('/')}/",
            "url_route": "retention",
            "destination": "nav",
            "category": "browse",
            "icon": f"{MOUNT.lstrip('/')}/icon.svg",
        }
    ]
