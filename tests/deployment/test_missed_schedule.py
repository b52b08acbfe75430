"""Drill: the schedule missed days (the DAG was paused, catchup is off). The ledger shows the gap until a
backfill fills it, and the verify task says so in words."""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.verify import missed_runs
from tests.deployment.conftest import day
from tests.deployment.harness import TEST_TIMEOUT, Deployment, budget
from tests.deployment.test_scheduler import backfill, finished

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

TABLE_SQL = """
DROP TABLE IF EXISTS drill.missed;
CREATE SCHEMA IF NOT EXISTS drill;
CREATE TABLE drill.missed (id bigint PRIMARY KEY, created_at timestamptz NOT NULL);
INSERT INTO drill.missed SELECT g, %(now)s::timestamptz - make_interval(mins => g) FROM generate_series(1, 14400) g;
CREATE INDEX ON drill.missed (created_at);
"""


def test_missed_days_show_as_a_gap_until_a_backfill_fills_them(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    policy = policy_map["missed_days"]
    dag_id = "retention_missed_days"
    with target.cursor() as cur:
        cur.execute(TABLE_SQL, {"now": day(0)})
    deployment.wait_for_dag(dag_id)
    # Unpaused today after five days paused; catchup is off, so the scheduler runs only today's run.
    deployment.unpause(dag_id)
    (run,) = deployment.wait_for_runs(dag_id, lambda rs: finished(rs, 1), budget(45))
    assert run["state"] == "success"
    assert run["logical_date"][:10] == day(0).date().isoformat()

    ledger = Ledger(policy.ledger_schema)
    missed = missed_runs(target, ledger, policy, day(-5), day(0))
    assert [m.anchor for m in missed] == [day(-5), day(-4), day(-3), day(-2), day(-1)]
    # The verify task of today's run said so in its log, in words.
    log = deployment.api(
        "GET",
        f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{dag_id}.verify/logs/1",
        params={"full_content": True},
    )
    text = json.dumps(log)
    # Today's run has the latest cutoff: it deleted everything the paused days' runs would have, so the
    # verify task lists them apart, with no backfill to run (a backfill still fills the ledger's gap).
    assert "5 scheduled run(s) after" in text and "have no complete run of their own" in text
    assert "already deleted what they would: no backfill needed" in text
    assert "could still delete rows" not in text

    backfill(deployment, dag_id, day(-2), day(-1), "none")
    assert [m.anchor for m in missed_runs(target, ledger, policy, day(-5), day(0))] == [day(-5), day(-4), day(-3)]
