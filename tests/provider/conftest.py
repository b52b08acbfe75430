"""Airflow-level fixtures: the metadata database of the throwaway AIRFLOW_HOME, the test DAGs, a test
table in the Airflow tests' own database, and a way to clear some tasks of a run and resume it."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from tests.conftest import DAGS_FOLDER, E2E_DSN

HERE = Path(__file__).resolve().parent
TEST_POLICIES = DAGS_FOLDER.parent / "test_policies.yaml"
os.environ["RETENTION_TEST_POLICIES"] = str(TEST_POLICIES)

ORDERS_POLICY = """
defaults:
  conn_id: retention_target
  ledger_schema: airflow_t_ledger
  schedule: "@daily"
  start_date: 2026-01-01
  retries: 0
  retry_delay: 1s
policies:
  - name: t_orders
    table: airflow_t.orders
    key_column: id
    timestamp_column: created_at
    tenant_column: tenant_id
    chunk_by: key
    condition: status <> 'open'
    retention: 10 days
    batch_size: 500
    chunk_rows: 2000
    lock_timeout: 1s
    max_active_chunks: 4
    pool: retention_pool
  - name: t_missing
    table: airflow_t.no_such_table
    key_column: id
    timestamp_column: created_at
    retention: 10 days
    retries: 3
  - name: t_audit_dry
    table: airflow_t.audit
    key_column: id
    timestamp_column: at
    retention: 10 days
    dry_run: true
  - name: t_audit_vacuum
    table: airflow_t.audit
    key_column: id
    timestamp_column: at
    retention: 10 days
    vacuum_after_rows: 1
  - name: t_parts
    table: airflow_t.parts
    timestamp_column: created_at
    retention: 10 days
    expired_partitions: drop
    batch_size: 500
    chunk_rows: 2000
  - name: t_odd
    table: '"airflow_t"."Uuid Events; x"'
    timestamp_column: '"Created At"'
    retention: 10 days
    batch_size: 500
    chunk_rows: 2000
"""

# 30,000 orders over 60 days from 2026-01-01; tenant 1 holds 3/4 of them; every 13th is still open.
ORDERS_SQL = """
DROP SCHEMA IF EXISTS airflow_t CASCADE;
DROP SCHEMA IF EXISTS airflow_t_ledger CASCADE;
CREATE SCHEMA airflow_t;
CREATE TABLE airflow_t.orders (
    id bigint PRIMARY KEY,
    tenant_id integer NOT NULL,
    created_at timestamptz NOT NULL,
    status text NOT NULL
);
INSERT INTO airflow_t.orders
SELECT i,
       CASE WHEN i % 4 = 0 THEN 2 + (i / 4) % 9 ELSE 1 END,
       timestamptz '2026-01-01' + make_interval(days => i % 60, secs => (i * 37) % 86400),
       CASE WHEN i % 13 = 0 THEN 'open' ELSE 'closed' END
FROM generate_series(1, 30000) i;
CREATE INDEX ON airflow_t.orders (created_at);
CREATE INDEX ON airflow_t.orders (tenant_id, id);
-- Partitioned by month of 2026, 100 rows a day; uuid-keyed with names that need quoting.
CREATE TABLE airflow_t.parts (id bigint NOT NULL, created_at timestamptz NOT NULL, PRIMARY KEY (id, created_at))
    PARTITION BY RANGE (created_at);
CREATE TABLE airflow_t.m01 PARTITION OF airflow_t.parts FOR VALUES FROM ('2026-01-01') TO ('2026-02-01');
CREATE TABLE airflow_t.m02 PARTITION OF airflow_t.parts FOR VALUES FROM ('2026-02-01') TO ('2026-03-01');
CREATE TABLE airflow_t.m03 PARTITION OF airflow_t.parts FOR VALUES FROM ('2026-03-01') TO ('2026-04-01');
CREATE TABLE airflow_t.m04 PARTITION OF airflow_t.parts FOR VALUES FROM ('2026-04-01') TO ('2026-05-01');
CREATE TABLE airflow_t.m05 PARTITION OF airflow_t.parts FOR VALUES FROM ('2026-05-01') TO ('2026-06-01');
INSERT INTO airflow_t.parts SELECT i, timestamptz '2026-01-01' + i * interval '864 seconds'
FROM generate_series(0, 14999) i;
CREATE TABLE airflow_t."Uuid Events; x" (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    "Created At" timestamptz NOT NULL
);
INSERT INTO airflow_t."Uuid Events; x" ("Created At")
SELECT timestamptz '2026-01-01' + i * interval '1 hour' FROM generate_series(0, 2999) i;
ANALYZE airflow_t.parts;
ANALYZE airflow_t."Uuid Events; x";
CREATE TABLE airflow_t.audit (id bigint PRIMARY KEY, at timestamptz NOT NULL);
INSERT INTO airflow_t.audit
SELECT i, timestamptz '2026-01-01' + make_interval(hours => i * 4) FROM generate_series(1, 500) i;
CREATE INDEX ON airflow_t.audit (at);
"""


@pytest.fixture(scope="session", autouse=True)
def airflow_db() -> None:
    """Migrate the SQLite metadata database and put the test DAGs in the dags folder."""
    for dag_file in (HERE / "dags").glob("*.py"):
        shutil.copy(dag_file, DAGS_FOLDER / dag_file.name)
    TEST_POLICIES.write_text(ORDERS_POLICY)
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        [str(airflow), "pools", "set", "retention_pool", "4", "retention database budget"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


@pytest.fixture
def target() -> Iterator[Any]:
    """Autocommit connection to the Airflow tests' database, with the orders table freshly built."""
    conn = psycopg2.connect(E2E_DSN)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(ORDERS_SQL)
    yield conn
    conn.close()


def query(conn: Any, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def write_policies(text: str) -> None:
    TEST_POLICIES.write_text(textwrap.dedent(text))


def load_dag(dag_id: str) -> Any:
    from airflow_retention.compat import dagbag

    bag = dagbag(str(DAGS_FOLDER))
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


def task_instances(dag_run: Any) -> list[Any]:
    from airflow import settings

    session = settings.Session()
    return sorted(dag_run.get_task_instances(session=session), key=lambda ti: (ti.task_id, ti.map_index))


def resume(dag: Any, dag_run: Any, clear: Callable[[Any], bool]) -> Any:
    """Clear the task instances of ``dag_run`` that ``clear`` selects (as a person does in the UI) and run
    the dag run on to its end, with the same loop as ``dag.test()`` (which would clear every task)."""
    from airflow import settings
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import clear_task_instances
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    try:  # Airflow 3.3
        from airflow.serialization.serialized_objects import DagSerialization
    except ImportError:  # Airflow 3.0-3.2
        from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization
    from airflow.sdk.definitions.dag import _run_task

    def run(ti: Any) -> None:
        if "task" in inspect.signature(_run_task).parameters:  # Airflow 3.1+
            _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
        else:  # Airflow 3.0: the task to run is the task instance's
            ti.task = dag.task_dict[ti.task_id]
            _run_task(ti=ti, run_triggerer=True)

    session = settings.Session()
    dr = session.scalar(select(DagRun).where(DagRun.dag_id == dag.dag_id, DagRun.run_id == dag_run.run_id))
    dr.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    tis = [ti for ti in dr.get_task_instances(session=session) if clear(ti)]
    assert tis, "nothing selected to clear"
    clear_task_instances(tis, session, dag_run_state=DagRunState.RUNNING)
    session.commit()
    finished = {TaskInstanceState.SUCCESS, TaskInstanceState.FAILED, TaskInstanceState.SKIPPED,
                TaskInstanceState.UPSTREAM_FAILED, TaskInstanceState.REMOVED}  # fmt: skip
    for _ in range(200):
        session.expire_all()
        dr = session.scalar(select(DagRun).where(DagRun.id == dr.id))
        dr.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        if dr.state != DagRunState.RUNNING:
            return dr
        schedulable, _ = dr.update_state(session=session)
        for ti in schedulable:
            if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                ti.try_number += 1
            ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        for ti in dr.get_task_instances(session=session):
            if ti.state == TaskInstanceState.SCHEDULED:
                run(ti)
        if all(ti.state in finished for ti in dr.get_task_instances(session=session)):
            continue
    raise AssertionError("dag run did not finish")


def xcom_values(dag_run: Any, task_id: str, key: str = "return_value") -> list[Any]:
    """The XCom values a task's instances pushed in a finished run, by map index."""
    from airflow import settings
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    session = settings.Session()
    rows = session.execute(
        select(XComModel.value)
        .where(XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id)
        .where(XComModel.task_id == task_id, XComModel.key == key)
        .order_by(XComModel.map_index)
    ).all()
    return [XComModel.deserialize_value(row) for row in rows]


def utc(day: str) -> datetime:
    from airflow_retention.demo.seed import utc_day

    return utc_day(day)
