"""A populated Airflow metadata database, and ``airflow db clean`` beside the metadata policies on two
identical copies of it: the side-by-side comparison of ``tests/metadata`` (small) and
``benchmarks/metadata_benchmark.py`` (1M and 10M ``log`` rows).

The data is a realistic mix, made in SQL on the schema ``airflow db migrate`` created: DAGs (some
paused, one removed long ago, one with only manual runs), two versions per DAG, daily runs of every run
type and state (failed ones, recent running ones, queued ones never started), task instances with
retries (their earlier tries in ``task_instance_history``), skipped ones without a start date, an XCom
per task that ran, ``log`` rows with and without a DAG, ``job`` heartbeats, reschedules, import errors,
unused triggers, callbacks in every state (some still waited on by a deadline) and task state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2.extensions import make_dsn, parse_dsn

from airflow_retention.demo.postgres import admin_execute, sqlalchemy_url


@dataclass(frozen=True)
class MetadataShape:
    """How much metadata: DAGs, days of daily runs, tasks per run, ``log`` and ``job`` rows."""

    dags: int = 20
    days: int = 120
    tasks: int = 3
    log_rows: int = 20_000
    job_rows: int = 2_000


SEED_SQL = """
INSERT INTO dag_bundle (name, active) VALUES ('dags-folder', true) ON CONFLICT DO NOTHING;
INSERT INTO dag (dag_id, is_paused, is_stale, bundle_name, timetable_type, partition_mapper_info, max_active_tasks,
                 max_consecutive_failed_dag_runs, has_task_concurrency_limits, last_parsed_time, fileloc)
SELECT format('dag_%%s', lpad(d::text, 4, '0')), d %% 5 = 4, false, 'dags-folder', 'cron', '{}'::json, 16, 0, false,
       %(anchor)s::timestamptz - interval '1 hour', '/dags/f.py'
FROM generate_series(0, %(dags)s - 1) d;
-- A DAG removed long ago: parsed last a year before, no version or run left.
INSERT INTO dag (dag_id, is_paused, is_stale, bundle_name, timetable_type, partition_mapper_info, max_active_tasks,
                 max_consecutive_failed_dag_runs, has_task_concurrency_limits, last_parsed_time)
VALUES ('removed_dag', false, true, 'dags-folder', 'cron', '{}'::json, 16, 0, false,
        %(anchor)s::timestamptz - interval '400 days');
INSERT INTO dag_version (id, version_number, dag_id, bundle_name, created_at, last_updated)
SELECT gen_random_uuid(), v, dag_id, 'dags-folder',
       %(anchor)s::timestamptz - (%(days)s + 10 - (v - 1) * 60) * interval '1 day',
       %(anchor)s::timestamptz
FROM dag, generate_series(1, 2) v WHERE dag_id <> 'removed_dag';
-- Daily runs; dag_0003 only manual ones; every 10th manual, every 7th a backfill; every 13th failed; the
-- last day's runs still running on every third DAG; a queued run never started on every fourth.
INSERT INTO dag_run (dag_id, run_id, run_type, state, logical_date, run_after, start_date, end_date, queued_at,
                     data_interval_start, data_interval_end, created_dag_version_id, clear_number, span_status)
SELECT dag.dag_id,
       format('%%s__%%s', rt, to_char(day, 'YYYY-MM-DD"T"HH24:MI:SS')),
       rt,
       CASE WHEN n = 0 AND dn %% 3 = 0 THEN 'running' WHEN n %% 13 = 5 THEN 'failed' ELSE 'success' END,
       day, day, day + interval '1 minute',
       CASE WHEN n = 0 AND dn %% 3 = 0 THEN NULL ELSE day + interval '20 minutes' END,
       day, day - interval '1 day', day,
       (SELECT id FROM dag_version v WHERE v.dag_id = dag.dag_id AND v.created_at <= day
        ORDER BY v.created_at DESC LIMIT 1),
       0, 'not_started'
FROM (SELECT dag_id, row_number() OVER (ORDER BY dag_id) - 1 AS dn FROM dag WHERE dag_id <> 'removed_dag') dag,
     generate_series(0, %(days)s - 1) n,
     LATERAL (SELECT date_trunc('day', %(anchor)s::timestamptz) - n * interval '1 day'
                     + (dag.dn %% 60) * interval '1 minute' AS day) d,
     LATERAL (SELECT CASE WHEN dag.dag_id = 'dag_0003' OR n %% 10 = 3 THEN 'manual'
                          WHEN n %% 7 = 2 THEN 'backfill' ELSE 'scheduled' END AS rt) r;
INSERT INTO dag_run (dag_id, run_id, run_type, state, logical_date, run_after, queued_at, clear_number, span_status)
SELECT dag_id, 'manual__queued', 'manual', 'queued', %(anchor)s::timestamptz - interval '200 days',
       %(anchor)s::timestamptz - interval '200 days', %(anchor)s::timestamptz - interval '200 days', 0, 'not_started'
FROM (SELECT dag_id, row_number() OVER (ORDER BY dag_id) AS dn FROM dag WHERE dag_id <> 'removed_dag') x
WHERE dn %% 4 = 0;
-- Task instances of the runs that started: every 11th skipped (no start date), every 9th retried once.
INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, start_date, end_date, duration, state, try_number,
                           max_tries, pool, pool_slots, queue, priority_weight, operator, dag_version_id, span_status)
SELECT gen_random_uuid(), format('t%%s', t), r.dag_id, r.run_id, -1,
       CASE WHEN (r.id + t) %% 11 = 0 THEN NULL ELSE r.start_date + t * interval '1 minute' END,
       CASE WHEN (r.id + t) %% 11 = 0 OR r.state = 'running' THEN NULL
            ELSE r.start_date + (t + 1) * interval '1 minute' END,
       60,
       CASE WHEN (r.id + t) %% 11 = 0 THEN 'skipped' WHEN r.state = 'running' THEN 'running' ELSE r.state END,
       CASE WHEN (r.id + t) %% 9 = 0 THEN 2 ELSE 1 END, 1, 'default_pool', 1, 'default', 1, 'PythonOperator',
       r.created_dag_version_id, 'not_started'
FROM dag_run r, generate_series(0, %(tasks)s - 1) t WHERE r.start_date IS NOT NULL;
INSERT INTO task_instance_history (task_instance_id, task_id, dag_id, run_id, map_index, try_number, start_date,
                                   end_date, state, pool, pool_slots, dag_version_id, span_status)
SELECT id, task_id, dag_id, run_id, map_index, 1, start_date - interval '30 seconds',
       start_date - interval '10 seconds',
       'failed', pool, pool_slots, dag_version_id, 'not_started'
FROM task_instance WHERE try_number = 2;
INSERT INTO xcom (dag_run_id, task_id, map_index, key, dag_id, run_id, value, timestamp)
SELECT r.id, ti.task_id, ti.map_index, 'return_value', ti.dag_id, ti.run_id, '1'::jsonb,
       ti.start_date + interval '30 seconds'
FROM task_instance ti JOIN dag_run r ON r.dag_id = ti.dag_id AND r.run_id = ti.run_id WHERE ti.start_date IS NOT NULL;
INSERT INTO task_reschedule (ti_id, start_date, end_date, duration, reschedule_date)
SELECT id, start_date, start_date + interval '5 seconds', 5, start_date + interval '1 minute'
FROM task_instance
WHERE start_date IS NOT NULL AND task_id = 't0' AND run_id LIKE 'scheduled%%' AND dag_id = 'dag_0001';
INSERT INTO log (dttm, dag_id, task_id, event, owner, extra)
SELECT %(anchor)s::timestamptz - (g::bigint * %(days)s * 86400 / %(log_rows)s) * interval '1 second',
       CASE WHEN g %% 10 = 0 THEN NULL ELSE format('dag_%%s', lpad((g %% %(dags)s)::text, 4, '0')) END,
       CASE WHEN g %% 10 = 0 THEN NULL ELSE 't0' END,
       CASE WHEN g %% 10 = 0 THEN 'cli_dags_list' ELSE 'running' END, 'airflow', md5(g::text)
FROM generate_series(1, %(log_rows)s) g;
INSERT INTO log (dttm, event) VALUES (NULL, 'no_time');
INSERT INTO job (dag_id, state, job_type, start_date, end_date, latest_heartbeat, hostname, unixname)
SELECT CASE WHEN g %% 3 = 0 THEN NULL ELSE format('dag_%%s', lpad((g %% %(dags)s)::text, 4, '0')) END,
       'success', CASE WHEN g %% 3 = 0 THEN 'SchedulerJob' ELSE 'LocalTaskJob' END,
       %(anchor)s::timestamptz - (g %% (%(days)s * 24)) * interval '1 hour',
       %(anchor)s::timestamptz - (g %% (%(days)s * 24)) * interval '1 hour' + interval '5 minutes',
       %(anchor)s::timestamptz - (g %% (%(days)s * 24)) * interval '1 hour' + interval '5 minutes', 'host', 'airflow'
FROM generate_series(1, %(job_rows)s) g;
-- Triggers nothing uses any more (Airflow's own clean_unused leaves these between its passes), callbacks
-- in every state, two of them still waited on by a deadline, and task state of the runs.
INSERT INTO trigger (classpath, kwargs, created_date)
SELECT 'airflow.triggers.temporal.DateTimeTrigger', '{}', %(anchor)s::timestamptz - g * interval '7 days'
FROM generate_series(1, 12) g;
INSERT INTO callback (id, type, fetch_method, data, priority_weight, created_at, state)
SELECT gen_random_uuid(), 'triggerer', 'import_path', '{}'::jsonb, 1, %(anchor)s::timestamptz - g * interval '6 days',
       (ARRAY['success', 'failed', 'scheduled', 'queued', 'running', NULL])[1 + g %% 6]
FROM generate_series(1, 24) g;
INSERT INTO deadline (id, created_at, last_updated_at, dagrun_id, deadline_time, missed, callback_id)
SELECT gen_random_uuid(), c.created_at, c.created_at, (SELECT min(id) FROM dag_run WHERE state = 'success'),
       c.created_at + interval '1 hour',
       false, c.id
FROM callback c WHERE c.state = 'scheduled' AND c.created_at < %(anchor)s::timestamptz - interval '60 days';
INSERT INTO task_state_store (dag_run_id, task_id, map_index, key, dag_id, run_id, value, updated_at, expires_at)
SELECT r.id, 't0', -1, 'cursor', r.dag_id, r.run_id, '1', r.start_date, r.start_date + interval '20 days'
FROM dag_run r WHERE r.start_date IS NOT NULL AND r.id %% 5 = 0;
INSERT INTO import_error (timestamp, filename, bundle_name, stacktrace)
SELECT %(anchor)s::timestamptz - g * interval '20 days', format('/dags/broken_%%s.py', g), 'dags-folder', 'Traceback'
FROM generate_series(1, 6) g;
"""


def seed_metadata(dsn: str, anchor: datetime, shape: MetadataShape = MetadataShape()) -> dict[str, int]:
    """Fill the migrated metadata database of ``dsn``; returns the row count of each table filled."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(SEED_SQL, {"anchor": anchor, **shape.__dict__})
            cur.execute("VACUUM ANALYZE")
        return table_counts(dsn)
    finally:
        conn.close()


COMPARED = (
    "trigger",
    "callback",
    "deadline",
    "task_state_store",
    "dag",
    "dag_version",
    "dag_run",
    "task_instance",
    "task_instance_history",
    "xcom",
    "task_reschedule",
    "log",
    "job",
    "import_error",
    "serialized_dag",
    "dag_code",
)


def table_counts(dsn: str, tables: tuple[str, ...] = COMPARED) -> dict[str, int]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            counts = {}
            for table in tables:
                cur.execute(f'SELECT count(*) FROM public."{table}"')
                counts[table] = int(cur.fetchone()[0])
            return counts
    finally:
        conn.close()


def checksums(dsn: str, before: datetime, tables: tuple[str, ...] = COMPARED) -> dict[str, tuple[int, str]]:
    """Per table: (rows, the sum of a 64-bit hash of every row's text): equal when the rows are (in any
    order), computed by the server in one scan. ``log`` rows written at or after ``before`` (the seed's
    anchor) are left out: ``airflow db clean`` logs its own run there."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            out = {}
            for table in tables:
                where = "WHERE t.dttm IS NULL OR t.dttm < %(before)s" if table == "log" else ""
                cur.execute(
                    f"SELECT count(*), coalesce(sum(('x' || substr(md5(t::text), 1, 16))::bit(64)::bigint), 0)::text"
                    f' FROM public."{table}" t {where}',
                    {"before": before},
                )
                rows, digest = cur.fetchone()
                out[table] = (int(rows), str(digest))
            return out
    finally:
        conn.close()


def clone_database(dsn: str, name: str) -> str:
    """``CREATE DATABASE name TEMPLATE <dsn's database>`` (no one may be connected to it); the clone's DSN."""
    source = parse_dsn(dsn)["dbname"]
    admin_execute(
        make_dsn(dsn, dbname="postgres"),
        f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
        f'CREATE DATABASE "{name}" TEMPLATE "{source}"',
    )
    return make_dsn(dsn, dbname=name)


def airflow_env(home: Path, dsn: str) -> dict[str, str]:
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(dsn),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
    }


def airflow_cli(home: Path, dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    airflow = Path(sys.executable).with_name("airflow")
    return subprocess.run(
        [str(airflow), *args], env=airflow_env(home, dsn), capture_output=True, text=True, check=False, timeout=3600
    )


def migrate(home: Path, dsn: str) -> None:
    done = airflow_cli(home, dsn, "db", "migrate")
    if done.returncode:
        raise RuntimeError(f"airflow db migrate failed: {done.stderr[-2000:]}")


def db_clean(home: Path, dsn: str, cutoff: datetime, *extra: str) -> float:
    """``airflow db clean`` as its users run it, without archive tables; returns its wall time."""
    started = time.monotonic()
    done = airflow_cli(
        home, dsn, "db", "clean", "--clean-before-timestamp", cutoff.isoformat(), "--skip-archive", "--yes", *extra
    )
    # Without --error-on-cleanup-failure (Airflow 3.3) a table that failed still exits 0: read its output too.
    if done.returncode or "Encountered error" in done.stdout + done.stderr:
        raise RuntimeError(f"airflow db clean failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return time.monotonic() - started


def run_policies(dsn: str, policies: list[Any], run_date: datetime) -> dict[str, Any]:
    """Each policy planned and run to the end (every chunk, verify), one after another in their order, as
    the metadata DAG chains them; returns per policy the rows deleted and the chunk count."""
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.planning.cutoff import freeze_cutoff
    from airflow_retention.core.planning.planner import plan_run
    from airflow_retention.core.running.engine import run_chunk
    from airflow_retention.core.running.verify import verify_run

    conn = psycopg2.connect(dsn)
    out: dict[str, Any] = {}
    try:
        for policy in policies:
            cutoff = freeze_cutoff(policy, run_date)
            plan = plan_run(conn, policy, cutoff, run_date=run_date)
            deleted = sum(run_chunk(conn, policy, cutoff, chunk).rows_deleted for chunk in plan.chunks)
            verification = verify_run(conn, Ledger(policy.ledger_schema), plan.run_key)
            if verification.missing or verification.left:
                raise RuntimeError(f"policy {policy.name}: run not complete: {verification}")
            out[policy.name] = {"deleted": deleted, "chunks": len(plan.chunks)}
    finally:
        conn.close()
    return out


def rows(dsn: str, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params or {})
            return list(cur.fetchall())
    finally:
        conn.close()


def scalar(dsn: str, sql: str, params: dict[str, Any] | None = None) -> Any:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params or {})
            return cur.fetchone()[0]
    finally:
        conn.close()


def execute(dsn: str, sql: str, params: dict[str, Any] | None = None) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params or {})
    finally:
        conn.close()


def drop_database(dsn: str) -> None:
    admin_execute(
        make_dsn(dsn, dbname="postgres"), f'DROP DATABASE IF EXISTS "{parse_dsn(dsn)["dbname"]}" WITH (FORCE)'
    )


def existing_tables(dsn: str, schema: str = "public") -> set[str]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))
            return {str(r[0]) for r in cur.fetchall()}
    finally:
        conn.close()
