"""One real Airflow deployment shared by every module here: metadata in PostgreSQL, LocalExecutor, the
project's ``dags/`` as dags folder, scheduler / dag-processor / api-server / triggerer as separate processes.

On a loaded machine: every wait polls, within a budget sized from runs measured with both cores busy
(``harness.budget``); a wait that runs out raises DeploymentTimeout with the deployment's diagnostics (task
instance states, PostgreSQL sessions, the end of each process's log), and any other failure of a test that
uses a deployment gets the same diagnostics as a report section. ``RETENTION_TEST_PATIENCE=2`` doubles every
budget; ``RETENTION_TEST_WAIT_LOG=FILE`` records each wait's time (the measured runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.seed import seed_examples
from tests.conftest import DSN, REPO, throwaway_database
from tests.deployment.harness import Deployment, DeploymentTimeout

TODAY = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
ARTIFACTS = REPO / "test-artifacts"


# The recovery drill (test_recovery_drill.py): 10 tenants x 4 chunks x 5,000 rows, four chunk tasks at once.
DRILL_POLICY = {
    "name": "drill_events",
    "table": "drill.events",
    "key_column": "id",
    "timestamp_column": "created_at",
    "tenant_column": "tenant_id",
    "chunk_by": "key",  # per-tenant key chunks of 5,000 rows: the drill's plan is exactly 40 chunks
    "retention": "1 day",
    "batch_size": 1000,
    "target_batch_time": 0,  # fixed batches: the drill holds a row of the victim's third batch
    "chunk_rows": 5000,
    "max_active_chunks": 4,
    "lock_timeout": "60s",
    "schedule": None,
    # The WAL rate recorded, not obeyed: beside the rest of the suite the server's WAL passes its limit,
    # and 500 fixed batches at the floor's duty cycle took the drill from 77 s to 187 s.
    "budget": {"max_wal_rate": False},
}
# The missed-schedule drill (test_missed_schedule.py): daily, catchup off, five days of history.
MISSED_POLICY = {
    "name": "missed_days",
    "table": "drill.missed",
    "key_column": "id",
    "timestamp_column": "created_at",
    "retention": "1 day",
    "batch_size": 500,
}
EXAMPLES = ("webhook_deliveries", "tenant_events", "audit_log", "api_requests")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed test's report carries what its deployment was doing (a timeout's message already does)."""
    report: pytest.TestReport = yield
    if report.failed and call.excinfo is not None and not call.excinfo.errisinstance(DeploymentTimeout):
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Deployment):
                value.failed = True  # keep its logs
                report.sections.append(("deployment diagnostics", value.diagnostics()))
    return report


def one(conn: Any, sql: str, params: Any = None) -> Any:
    """The one row of a query on an autocommit connection."""
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()


def day(offset: int) -> datetime:
    """Midnight UTC ``offset`` days from today (negative: in the past)."""
    return TODAY + timedelta(days=offset)


def policies_yaml(path: Path) -> Path:
    """The example policies, made to exercise the scheduler: webhook deliveries scheduled with catchup
    from two days ago; the others without catchup (the backfill and UI tests fill their missed days)."""
    doc = yaml.safe_load((REPO / "dags" / "retention_policies.yaml").read_text())
    doc["defaults"].update({"retries": 1, "retry_delay": "2s"})
    for policy in doc["policies"]:
        policy["start_date"] = day(-2 if policy["name"] == "webhook_deliveries" else -12).isoformat()
        policy["catchup"] = policy["name"] == "webhook_deliveries"
    doc["policies"].append(DRILL_POLICY)
    doc["policies"].append({**MISSED_POLICY, "start_date": day(-5).isoformat(), "catchup": False})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="package")
def target_dsn() -> Iterator[str]:
    with throwaway_database("retention_target") as dsn:
        yield dsn


@pytest.fixture(scope="package")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return policies_yaml(tmp_path_factory.mktemp("policies") / "policies.yaml")


@pytest.fixture(scope="package")
def policy_map(policies: Path) -> dict[str, RetentionPolicy]:
    return {p.name: p for p in load_policies(policies)}


@pytest.fixture(scope="package")
def target(target_dsn: str, policy_map: dict[str, RetentionPolicy]) -> Iterator[Any]:
    """The example tables, seeded around today's cutoffs; an autocommit connection to them."""
    conn = psycopg2.connect(target_dsn)
    cutoffs = {name: [freeze_cutoff(policy_map[name], day(d)) for d in range(-12, 1)] for name in EXAMPLES}
    seed_examples(conn, TODAY, cutoffs)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture(scope="package")
def deployment(target: Any, target_dsn: str, policies: Path) -> Iterator[Deployment]:
    with Deployment(
        server_dsn=DSN,
        target_dsn=target_dsn,
        dags_folder=REPO / "dags",
        env={"AIRFLOW_RETENTION_POLICIES": str(policies)},
    ) as running:
        yield running
