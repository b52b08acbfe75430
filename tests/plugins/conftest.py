"""The Retention view's browser test: a target database with a ledger of real runs, and an Airflow
deployment of just the api-server (the view needs no scheduler) whose policies file also names a policy
whose connection points nowhere."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.policy import RetentionPolicy
from tests.conftest import DSN, throwaway_database
from tests.deployment.harness import Deployment

from .helpers import Seeded, seed_runs, view_policy_data

SCHEMA = "shop"
BROKEN_CONN = "postgres://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1


class ApiServerOnly(Deployment):
    """The harness's deployment with the api-server alone: healthy once it answers with its metadata database."""

    def wait_healthy(self, timeout: float) -> None:
        import requests

        def up() -> bool:
            try:
                health = requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=5).json()
            except (requests.RequestException, ValueError):
                return False
            return (health.get("metadatabase") or {}).get("status") == "healthy"

        self.wait_until(up, timeout, "the api-server")


@pytest.fixture(scope="module")
def view_target() -> Iterator[str]:
    with throwaway_database("retention_view") as dsn:
        yield dsn


@pytest.fixture(scope="module")
def view_admin(view_target: str) -> Iterator[Any]:
    conn = psycopg2.connect(view_target)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def view_seeded(view_target: str, view_admin: Any) -> Seeded:
    """Runs of the last five days (today's anchor minus 5 .. minus 2; minus 4 left running)."""
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    first = today - timedelta(days=5)
    policy = RetentionPolicy.from_dict(view_policy_data(SCHEMA, "retention_target", first))
    with view_admin.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{SCHEMA}"')
    conn = psycopg2.connect(view_target)
    try:
        return seed_runs(view_admin, conn, SCHEMA, policy, first)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def view_deployment(
    view_target: str, view_seeded: Seeded, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("view")
    policy = view_policy_data(SCHEMA, "retention_target", view_seeded.anchors[0])
    broken = view_policy_data(SCHEMA, "retention_broken", view_seeded.anchors[0], name="unreachable")
    policies = folder / "policies.yaml"
    policies.write_text(yaml.safe_dump({"policies": [policy, broken]}, sort_keys=False))
    dags = folder / "dags"  # the api-server parses no DAG: an empty dags folder will do
    dags.mkdir()
    env = {"AIRFLOW_RETENTION_POLICIES": str(policies), "AIRFLOW_CONN_RETENTION_BROKEN": BROKEN_CONN}
    with ApiServerOnly(
        server_dsn=DSN, target_dsn=view_target, dags_folder=Path(dags), env=env, components=("api-server",)
    ) as running:
        yield running
