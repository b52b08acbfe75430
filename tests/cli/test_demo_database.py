"""The command on the demo's layout (its three example tables and policies, in a database of its own),
through the installed console script as a subprocess, resolving the policies' ``conn_id`` from
``AIRFLOW_CONN_RETENTION_TARGET`` as Airflow would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.demo.__main__ import NIGHTLY, demo_policies
from airflow_retention.demo.postgres import admin_execute, airflow_connection_json
from airflow_retention.demo.seed import Shape, seed_examples, utc_day

from ..conftest import DSN, REPO
from .helpers import run_cli

SCRIPT = Path(sys.executable).with_name("airflow-retention")
DAY = "2026-06-06"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The demo's tables, seeded small, in a fresh database; tenant_events of DAY planned with one chunk
    purged; the other policies never planned."""
    name = f"retention_cli_{uuid.uuid4().hex[:8]}"
    admin_execute(DSN, f'CREATE DATABASE "{name}"')
    dsn = make_dsn(DSN, dbname=name)
    saved = os.environ.get("AIRFLOW_RETENTION_POLICIES")
    path = demo_policies(REPO / "dags" / "retention_policies.yaml", tmp_path_factory.mktemp("demo") / "policies.yaml")
    if saved is None:  # demo_policies points the DAG file at its copy; this process needs no such thing
        os.environ.pop("AIRFLOW_RETENTION_POLICIES", None)
    else:
        os.environ["AIRFLOW_RETENTION_POLICIES"] = saved
    policies = {p.name: p for p in load_policies(path)}
    conn = psycopg2.connect(dsn)
    try:
        cutoffs = {n: [freeze_cutoff(p, utc_day(d)) for d in NIGHTLY] for n, p in policies.items()}
        seed_examples(conn, utc_day("2026-06-10"), cutoffs, Shape(webhooks=2_000, events=60_000, audit=1_000))
        events = policies["tenant_events"]
        cutoff = freeze_cutoff(events, utc_day(DAY))
        plan = plan_run(conn, events, cutoff)
        assert len(plan.chunks) >= 2
        done = run_chunk(conn, events, cutoff, plan.chunks[0])
        yield {"dsn": dsn, "policies": str(path), "plan": plan, "done": done}
    finally:
        conn.close()
        admin_execute(DSN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def script(demo: dict[str, Any], *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, with the policies' connection given the way Airflow reads it."""
    env = {**os.environ, "AIRFLOW_CONN_RETENTION_TARGET": airflow_connection_json(demo["dsn"])}
    env.pop("AIRFLOW_RETENTION_POLICIES", None)
    return subprocess.run(
        [str(SCRIPT), "--policies", demo["policies"], *argv], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.solo
def test_help_is_fast_and_does_not_import_airflow() -> None:
    assert SCRIPT.is_file(), f"{SCRIPT} missing: pip install -e . installs the console script"
    started = time.perf_counter()
    result = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "init-ledger" in result.stdout
    assert time.perf_counter() - started < 1.5
    probe = (
        "import sys; from airflow_retention.cli.main import build_parser; build_parser();"
        " print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "[]"


def test_status_plan_and_verify_on_the_demo_layout(demo: dict[str, Any]) -> None:
    plan, done = demo["plan"], demo["done"]
    status = script(demo, "status", "--as-of", "2026-06-06T12:00:00Z")
    assert status.returncode == 0, status.stderr
    assert "tenant_events" in status.stdout and "webhook_deliveries" in status.stdout
    assert f"1/{len(plan.chunks)}" in status.stdout
    assert "no run in the ledger yet" in status.stdout  # audit_log, webhook_deliveries: nothing planned
    # Every demo night up to DAY is missed for the two policies never planned; tenant_events lacks 5 of 6.
    assert (
        "6 scheduled run(s) without a complete run in the ledger that could still delete rows (6 never planned)"
        in " ".join(status.stdout.split())
    )

    data = json.loads(script(demo, "--json", "status", "tenant_events").stdout)
    run = data["policies"][0]["runs"][0]
    assert run["run_key"] == plan.run_key and run["rows_deleted"] == done.rows_deleted > 0
    assert run["running"] is True and run["cutoff"] == "2026-03-08T00:00:00+00:00"

    planned = script(demo, "--json", "plan", "webhook_deliveries", "--date", DAY)
    assert planned.returncode == 0, planned.stderr
    preview = json.loads(planned.stdout)
    assert preview["run_key"] == "webhook_deliveries@2026-05-07T00:00:00Z"
    assert preview["rows_planned"] > 0 and preview["stored_run"] is None

    verify = script(demo, "verify", "tenant_events", "--date", DAY)
    assert verify.returncode == 1
    assert f"run {plan.run_key}: 1 of {len(plan.chunks)} expected chunk(s) complete" in verify.stdout
    assert plan.chunks[1].key in verify.stdout


def test_in_process_on_the_demo_layout_with_dsn(demo: dict[str, Any], capsys: Any) -> None:
    follow = run_cli(
        capsys, "--policies", demo["policies"], "--dsn", demo["dsn"], "status", "--follow", demo["plan"].run_key,
        "--iterations", "1",
    )  # fmt: skip
    assert follow.code == 0, follow.err
    assert f"1/{len(demo['plan'].chunks)}" in follow.out
    nothing = run_cli(capsys, "--policies", demo["policies"], "--dsn", demo["dsn"], "verify", "audit_log")
    assert nothing.code == 2 and "has no run in the ledger yet" in nothing.err
