"""Airflow's own metadata database purged under a live deployment (issue 23): scheduler, dag-processor,
api-server and triggerer as processes over a PostgreSQL metadata database; the DAG that
``init --airflow-metadata`` writes purges that same database while a DAG scheduled every minute keeps
being scheduled and run, and a DAG whose latest run is older than the cutoff is scheduled again after.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from psycopg2.extensions import make_dsn

from airflow_retention.demo.postgres import airflow_connection_json
from airflow_retention.scaffold import METADATA_DAG_FILE, METADATA_SETTINGS_FILE, source
from tests.conftest import DSN
from tests.deployment.harness import Deployment, budget

pytestmark = pytest.mark.scheduler

NOW = datetime.now(timezone.utc)
DAGS = """
from datetime import datetime
from airflow.sdk import DAG, task

with DAG("ticker", schedule="* * * * *", start_date=datetime(2026, 1, 1), catchup=False):
    @task
    def tick() -> int:
        return 1
    tick()

with DAG("old_dag", schedule="@daily", start_date=datetime(2026, 1, 1), catchup=False):
    @task
    def work() -> int:
        return 2
    work()
"""
# Old history of both DAGs: a run a day for 120 days, the last one 40 days ago (older than the cutoff).
HISTORY = """
INSERT INTO dag_run (dag_id, run_id, run_type, state, logical_date, run_after, start_date, end_date, queued_at,
                     data_interval_start, data_interval_end, created_dag_version_id, clear_number, span_status)
SELECT d.dag_id, format('scheduled__old_%%s', n), 'scheduled', 'success', day, day, day, day + interval '1 minute',
       day, day - interval '1 day', day, v.id, 0, 'ended'
FROM (VALUES ('ticker'), ('old_dag')) d(dag_id)
JOIN LATERAL (SELECT id FROM dag_version WHERE dag_id = d.dag_id ORDER BY created_at DESC LIMIT 1) v ON true,
     generate_series(40, 160) n,
     LATERAL (SELECT date_trunc('day', now()) - n * interval '1 day' AS day) x;
INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, start_date, end_date, state, try_number, max_tries,
                           pool, pool_slots, queue, priority_weight, operator, dag_version_id, span_status)
SELECT gen_random_uuid(), CASE r.dag_id WHEN 'ticker' THEN 'tick' ELSE 'work' END, r.dag_id, r.run_id, -1,
       r.start_date, r.end_date, 'success', 1, 0, 'default_pool', 1, 'default', 1, '_PythonDecoratedOperator',
       r.created_dag_version_id, 'ended'
FROM dag_run r WHERE r.run_id LIKE 'scheduled\\_\\_old\\_%%';
INSERT INTO log (dttm, dag_id, event, owner) SELECT now() - n * interval '1 hour', 'ticker', 'old', 'airflow'
FROM generate_series(24 * 40, 24 * 160) n;
"""


def scaffold(folder: Path) -> None:
    """The two files of ``init --airflow-metadata``, with retention 30 days and no schedule (triggered)."""
    (folder / METADATA_DAG_FILE).write_text(source(METADATA_DAG_FILE))
    settings = yaml.safe_load(source(METADATA_SETTINGS_FILE))
    settings["airflow_metadata"]["retention"] = "30 days"
    settings["airflow_metadata"]["policy"]["schedule"] = None
    (folder / METADATA_SETTINGS_FILE).write_text(yaml.safe_dump(settings))
    (folder / "test_dags.py").write_text(textwrap.dedent(DAGS))


@pytest.fixture
def metadata_deployment(tmp_path: Path, target_dsn: str) -> Iterator[Deployment]:
    scaffold(tmp_path)
    # The DAG files never change: each is parsed at the start, then every 30 s rather than 5 (a CPU-second each).
    deployment = Deployment(server_dsn=DSN, target_dsn=target_dsn, dags_folder=tmp_path, parse_interval=30)
    deployment.env["AIRFLOW_CONN_AIRFLOW_METADATA"] = airflow_connection_json(
        make_dsn(DSN, dbname=deployment.metadata_db)
    )
    with deployment as running:
        yield running


def query(deployment: Deployment, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(make_dsn(DSN, dbname=deployment.metadata_db))
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []
    finally:
        conn.close()


def done(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that succeeded, but the seeded history."""
    return [r for r in runs if r["state"] == "success" and not r["dag_run_id"].startswith("scheduled__old_")]


def latest_runs(deployment: Deployment, dag_id: str) -> list[dict[str, Any]]:
    params = {"order_by": "-logical_date", "limit": 50}
    return deployment.api("GET", f"/dags/{dag_id}/dagRuns", params=params)["dag_runs"]


def wait_for_new_runs(deployment: Deployment, dag_id: str, more_than: int, timeout: float) -> list[dict[str, Any]]:
    return deployment.wait_until(
        lambda: (runs := done(latest_runs(deployment, dag_id))) and len(runs) > more_than and runs,
        timeout,
        f"more than {more_than} new successful run(s) of {dag_id}",
    )


def test_the_scheduler_keeps_running_dags_while_their_history_is_purged(metadata_deployment: Deployment) -> None:
    d = metadata_deployment
    for dag_id in ("ticker", "old_dag", "retention_airflow_metadata"):
        d.wait_for_dag(dag_id)
    query(d, HISTORY, {})
    old = "SELECT count(*) FROM dag_run WHERE dag_id = %s AND start_date < now() - interval '30 days'"
    assert query(d, old, ("ticker",))[0][0] == 121 and query(d, old, ("old_dag",))[0][0] == 121
    d.unpause("ticker")
    wait_for_new_runs(d, "ticker", 0, budget(90))

    d.unpause("retention_airflow_metadata")
    purge = d.api("POST", "/dags/retention_airflow_metadata/dagRuns", json={"logical_date": NOW.isoformat()})
    finished = d.wait_until(
        lambda: (
            (r := d.api("GET", f"/dags/retention_airflow_metadata/dagRuns/{purge['dag_run_id']}"))["state"]
            in ("success", "failed")
            and r
        ),
        timeout=budget(300),
        what="the metadata purge",
    )
    assert finished["state"] == "success", finished
    started = datetime.fromisoformat(finished["start_date"].replace("Z", "+00:00"))

    # The purge removed the old history but each DAG's latest non-manual run (old_dag's is 40 days old).
    assert query(d, old, ("ticker",))[0][0] == 0
    assert query(d, old, ("old_dag",))[0][0] == 1
    assert query(d, "SELECT count(*) FROM log WHERE event = 'old' AND dttm < now() - interval '30 days'")[0][0] == 0
    # Every table's run is complete in the ledger of the metadata database.
    states = query(d, "SELECT policy, state FROM airflow_retention.runs")
    assert len(states) >= 15 and all(state == "complete" for _, state in states), states
    # Meanwhile the scheduler kept scheduling and running the ticker, and goes on after.
    count = len(done(latest_runs(d, "ticker")))
    after = wait_for_new_runs(d, "ticker", count, budget(120))
    # A run a minute: the scheduler queued one within 75 s of the purge's start, and the purge was still
    # running then, or it ended sooner and the next run came right after.
    queued = [datetime.fromisoformat(r["queued_at"].replace("Z", "+00:00")) for r in after if r.get("queued_at")]
    first_after_start = min((q for q in queued if q >= started), default=None)
    assert first_after_start is not None and first_after_start - started <= timedelta(seconds=75), (started, queued)
    # The DAG whose latest run was older than the cutoff is scheduled again.
    d.unpause("old_dag")
    runs = d.wait_for_runs(
        "old_dag",
        lambda rs: any(r["state"] == "success" and "old" not in r["dag_run_id"] for r in rs),
        timeout=budget(120),
    )
    assert any(r["run_type"] == "scheduled" and "old" not in r["dag_run_id"] for r in runs)
    d.pause("ticker")
