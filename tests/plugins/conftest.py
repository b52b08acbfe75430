"""The Retention view's browser and HTTP tests: a target database with a ledger of real runs, and an Airflow
deployment of just the api-server (the view needs no scheduler) whose policies file (:func:`view_policies`)
also names a policy whose connection points nowhere, one whose table is not in the database, one whose
last plan failed, and two invalid policies; events_purge's run planned last stopped on a chunk error.

Its auth manager is :mod:`.limited_auth`: ``admin`` may read everything; ``limited`` (a viewer) may read
the DAGs of :data:`LIMITED_DAGS` and no connection; ``outsider`` (a viewer) may read no DAG. The DAGs are
written to the metadata database by ``airflow dags reserialize`` from the project's DAG file, since the
auth manager's DAG filter knows only the DAGs Airflow has parsed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DSN, REPO, throwaway_database
from tests.deployment.harness import Deployment

from .helpers import Seeded, seed_budget_pressure, seed_runs, view_policy_data
from .limited_auth import GRANTS_ENV

SCHEMA = "shop"
# Nothing listens on port 1; the user and database names are there to be looked for in the pages.
BROKEN_USER, BROKEN_DB = "view_broken_user", "view_broken_db"
BROKEN_CONN = f"postgres://{BROKEN_USER}@127.0.0.1:1/{BROKEN_DB}"
USERS = ("admin", "limited", "outsider")
# The DAGs ``limited`` may read: the unreachable policy's, the missing table's, the failed plan's and one
# invalid policy's; not events_purge's (the ledger's runs), not the invalid policies' DAG of the entries
# without a name.
LIMITED_DAGS = ("retention_unreachable", "retention_missing_table", "retention_stalled", "retention_bad_retention")
# The failed plan the ledger records for the policy ``stalled`` (a plan that raised once the ledger existed).
PLAN_ERROR = "canceling statement due to statement timeout (SQLSTATE 57014)"


def view_policies(anchor: datetime) -> list[dict[str, Any]]:
    """The deployment's policies file: add entries here (a DAG id per entry: ``retention_<name>``)."""
    unnamed = {k: v for k, v in view_policy_data(SCHEMA, "retention_target", anchor).items() if k != "name"}
    return [
        view_policy_data(SCHEMA, "retention_target", anchor),  # events_purge: the seeded runs
        view_policy_data(SCHEMA, "retention_broken", anchor, name="unreachable"),
        # The connection reaches a database without the table: the next plan fails, the view says so.
        {**view_policy_data(SCHEMA, "retention_target", anchor, name="missing_table"), "table": f"{SCHEMA}.gone"},
        view_policy_data(SCHEMA, "retention_target", anchor, name="stalled"),  # its last plan failed
        {**view_policy_data(SCHEMA, "retention_target", anchor, name="bad_retention"), "retention": "soon-ish"},
        unnamed,  # shown under retention_invalid_policies
    ]


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

    def password(self, username: str) -> str:
        data = json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())
        return str(data[username])

    def token_for(self, username: str) -> str:
        """A REST API token of ``username`` (``POST /auth/token``, as an API client gets one)."""
        import requests

        response = requests.post(
            f"{self.base_url}/auth/token",
            json={"username": username, "password": self.password(username)},
            timeout=30,
        )
        response.raise_for_status()
        return str(response.json()["access_token"])


def stopped(admin: Any, ledger_schema: str, run_key: str) -> None:
    """Make ``run_key`` the run planned last, whose last batch was half an hour ago: a chunk error of it is
    then a failure (no retry is still to come), not yet a stuck run."""
    with admin.cursor() as cur:
        cur.execute(f'UPDATE "{ledger_schema}".runs SET planned_at = now() WHERE run_key = %s', (run_key,))
        cur.execute(
            f"UPDATE \"{ledger_schema}\".chunks SET last_batch_at = now() - interval '30 minutes'"
            " WHERE run_key = %s AND last_batch_at IS NOT NULL",
            (run_key,),
        )


@pytest.fixture(scope="package")
def view_target() -> Iterator[str]:
    with throwaway_database("retention_view") as dsn:
        yield dsn


@pytest.fixture(scope="package")
def view_admin(view_target: str) -> Iterator[Any]:
    conn = psycopg2.connect(view_target)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture(scope="package")
def view_seeded(view_target: str, view_admin: Any) -> Seeded:
    """Runs of the last five days (today's anchor minus 5 .. minus 2; minus 4 left running), and the
    database budget's pressure around them."""
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    first = today - timedelta(days=5)
    policy = RetentionPolicy.from_dict(view_policy_data(SCHEMA, "retention_target", first))
    with view_admin.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{SCHEMA}"')
    conn = psycopg2.connect(view_target)
    try:
        seeded = seed_runs(view_admin, conn, SCHEMA, policy, first)
        # The run stopped on a chunk error becomes the one planned last, with no batch for half an hour:
        # events_purge is failing.
        stopped(view_admin, policy.ledger_schema, seeded.partial)
        # The budget paused for a standby's lag since that run's last batch (throttled, not stuck), and
        # the last complete run held at the budget's floor (the SLO's exhausted budget).
        seed_budget_pressure(view_admin, policy.ledger_schema, seeded.partial, seeded.complete[-1])
        stalled = RetentionPolicy.from_dict(view_policy_data(SCHEMA, "retention_target", first, name="stalled"))
        key = run_key(stalled, freeze_cutoff(stalled, today))
        by = f"retention_stalled/scheduled__{today:%Y-%m-%dT%H:%M:%S}+00:00/-1/try 3"
        cutoff = freeze_cutoff(stalled, today)
        assert Ledger(stalled.ledger_schema).record_plan_failure(conn, "stalled", key, cutoff, PLAN_ERROR, by)
        return seeded
    finally:
        conn.close()


@pytest.fixture(scope="package")
def view_deployment(
    view_target: str, view_seeded: Seeded, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("view")
    policies = folder / "policies.yaml"
    policies.write_text(yaml.safe_dump({"policies": view_policies(view_seeded.anchors[0])}, sort_keys=False))
    dags = folder / "dags"  # the project's DAG file alone, parsed once by `airflow dags reserialize` below
    dags.mkdir()
    shutil.copy(REPO / "dags" / "retention_dags.py", dags)
    env = {
        "AIRFLOW_RETENTION_POLICIES": str(policies),
        "AIRFLOW_CONN_RETENTION_BROKEN": BROKEN_CONN,
        "AIRFLOW__CORE__AUTH_MANAGER": "tests.plugins.limited_auth.LimitedAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,limited:viewer,outsider:viewer",
        GRANTS_ENV: json.dumps({"limited": LIMITED_DAGS, "outsider": []}),
        # The api-server imports the auth manager from the tests; the `airflow` script does not put the
        # working directory on sys.path.
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    with ApiServerOnly(
        server_dsn=DSN, target_dsn=view_target, dags_folder=Path(dags), env=env, components=("api-server",)
    ) as running:
        running.airflow("dags", "reserialize")
        yield running
