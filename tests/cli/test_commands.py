"""The ``airflow-retention`` command against the real PostgreSQL: status, plan, verify, init-ledger, the
progress of a running purge, JSON output and errors. Runs ``main([...])`` in-process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_retention.cli.alerts import FAILING_KINDS
from airflow_retention.cli.runs import progress_of
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.schema import SCHEMA_VERSION
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers

from ..conftest import DSN
from ..core.helpers import (
    CUTOFF,
    FLOOR_DUTY,
    FLOOR_LEVEL,
    create_events,
    eligible_ids,
    fill_events,
    make_policy,
    rows,
    scalar,
)
from .helpers import RUN_DATE, policy_data, run_cli, write_policies


@pytest.fixture
def conn(dsn: str) -> Iterator[Any]:
    """psycopg2, the driver of the command (the core's driver matrix is tested in tests/core)."""
    c = psycopg2.connect(dsn)
    yield c
    c.close()


@pytest.fixture
def setup(admin: Any, schema: str, tmp_path: Path) -> dict[str, Any]:
    """A 2,000-row events table (about 1,030 eligible rows at CUTOFF), its policy in chunks of 300 rows,
    and the policies file; nothing planned yet."""
    table = create_events(admin, schema)
    fill_events(admin, table, 2000)
    path = write_policies(tmp_path / "policies.yaml", policy_data(schema, chunk_rows=300))
    return {
        "table": table,
        "policy": make_policy(schema, chunk_rows=300),
        "args": ["--policies", str(path), "--dsn", DSN],
        "eligible": len(eligible_ids(admin, table)),
    }


def schema_exists(admin: Any, name: str) -> bool:
    return bool(scalar(admin, "SELECT count(*) FROM pg_namespace WHERE nspname = %(n)s", {"n": name}))


def run_key_of(policy: Any) -> str:
    return f"{policy.name}@2024-06-01T12:00:00Z"


def test_plan_counts_chunks_and_writes_nothing_on_a_fresh_database(
    capsys: Any, setup: dict[str, Any], admin: Any
) -> None:
    policy = setup["policy"]
    result = run_cli(capsys, *setup["args"], "plan", "events_purge", "--date", RUN_DATE)
    assert result.code == 0, result.err
    assert f"plan of run {run_key_of(policy)}" in result.out
    # Key chunks count their rows: no "~"; no tenant groups in a policy without tenants.
    assert f"  4 chunk(s), {setup['eligible']:,} eligible row(s), chunk_rows 300\n" in result.out
    assert "~" not in result.out and "tenant group" not in result.out
    assert "all:1-" in result.out and "total" in result.out
    assert not schema_exists(admin, policy.ledger_schema)

    data = run_cli(capsys, *setup["args"], "plan", "events_purge", "--cutoff", "2024-06-01T12:00:00Z", "--json").json()
    assert data["run_key"] == run_key_of(policy)
    assert data["cutoff"] == "2024-06-01T12:00:00+00:00"
    assert data["rows_planned"] == setup["eligible"] == sum(c["rows_planned"] for c in data["chunks"])
    assert data["rows_estimated"] is False and data["tenant_groups"] == 1  # the JSON keeps its keys
    assert data["chunks_count"] == len(data["chunks"]) == 4
    assert [c["seq"] for c in data["chunks"]] == [0, 1, 2, 3]
    assert data["stored_run"] is None
    assert set(data["chunks"][0]) == {"seq", "chunk_key", "tenants", "lo", "hi", "rows_planned", "partition", "action"}
    assert data["partitions"] == []
    assert not schema_exists(admin, policy.ledger_schema)


def test_plan_lists_each_partition_with_its_action(capsys: Any, admin: Any, schema: str, tmp_path: Path) -> None:
    from ..core.partition_helpers import EXPIRED_MONTHS, create_monthly

    create_monthly(admin, schema)
    data = policy_data(schema, chunk_by="block", key_column=None, condition=None, expired_partitions="drop")
    path = write_policies(tmp_path / "policies.yaml", data)
    args = ["--policies", str(path), "--dsn", DSN, "plan", "events_purge", "--date", RUN_DATE]
    result = run_cli(capsys, *args)
    assert result.code == 0, result.err
    lines = [line.split() for line in result.out.splitlines()]
    for month in EXPIRED_MONTHS:
        assert [f"{schema}.{month}", "drop"] in [line[:2] for line in lines]
    assert [f"{schema}.m06", "delete", "rows"] in [line[:3] for line in lines]
    assert [f"{schema}.m07", "skip"] in [line[:2] for line in lines]
    found = run_cli(capsys, *args, "--json").json()
    actions = {p["partition"]: (p["action"], p["chunks"]) for p in found["partitions"]}
    assert actions[f"{schema}.m01"] == ("drop", 1) and actions[f"{schema}.m07"] == ("skip", 0)
    assert actions[f"{schema}.m06"][0] == "delete rows" and actions[f"{schema}.m06"][1] >= 1
    assert sum(1 for c in found["chunks"] if c["action"] == "drop") == len(EXPIRED_MONTHS)
    # Whole partitions are planned by their statistics: the totals say they are estimates.
    assert found["rows_estimated"] is True
    assert f"~{found['rows_planned']:,} eligible row(s) (estimated)" in result.out and "tenant group" not in result.out
    assert not schema_exists(admin, f"{schema}_ledger")


def test_plan_marks_a_sample_estimate_and_shows_tenant_groups_only_for_tenant_key_chunks(
    capsys: Any, admin: Any, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_retention.core.planning.walkers import blocks

    table = create_events(admin, schema)
    fill_events(admin, table, 2000)
    eligible = len(eligible_ids(admin, table))
    # A sample of about a quarter of the 2,000 rows: the plan's rows are an estimate, and say so.
    monkeypatch.setattr(blocks, "BLOCK_SAMPLE_ROWS", 500)
    path = write_policies(tmp_path / "policies.yaml", policy_data(schema, chunk_by="block", tenant_column="tenant_id"))
    args = ["--policies", str(path), "--dsn", DSN, "plan", "events_purge", "--date", RUN_DATE]
    found = run_cli(capsys, *args, "--json").json()
    assert found["rows_estimated"] is True and found["rows_planned"] != eligible  # 1 block in 4: not the count
    text = run_cli(capsys, *args).out
    assert f"~{found['rows_planned']:,} eligible row(s) (estimated)," in text
    assert ["total", f"~{found['rows_planned']:,}"] in [line.split() for line in text.splitlines()]
    assert "tenant group" not in text  # block chunks take every tenant in one pass

    # Key chunks of a policy with tenants: counted, one group per tenant.
    write_policies(path, policy_data(schema, tenant_column="tenant_id"))
    text = run_cli(capsys, *args).out
    assert f"  1 chunk(s), {eligible:,} eligible row(s), 1 tenant group(s)," in text and "~" not in text


def test_plan_adds_no_run_to_an_existing_ledger_and_names_a_stored_one(
    capsys: Any, setup: dict[str, Any], admin: Any, conn: Any
) -> None:
    policy = setup["policy"]
    plan_run(conn, policy, CUTOFF - timedelta(days=1))  # the ledger exists, with another run
    before = rows(admin, f'SELECT run_key FROM "{policy.ledger_schema}".runs')
    result = run_cli(capsys, *setup["args"], "--json", "plan", "events_purge", "--date", RUN_DATE)
    assert result.code == 0, result.err
    assert result.json()["stored_run"] is None
    assert rows(admin, f'SELECT run_key FROM "{policy.ledger_schema}".runs') == before

    plan_run(conn, policy, CUTOFF)
    result = run_cli(capsys, *setup["args"], "plan", "events_purge", "--date", RUN_DATE)
    assert "already in the ledger" in result.out and "reuse" in result.out


def test_status_verify_and_progress_of_a_partly_purged_run(
    capsys: Any, setup: dict[str, Any], conn: Any, admin: Any
) -> None:
    policy = setup["policy"]
    ledger = Ledger(policy.ledger_schema)
    plan = plan_run(conn, policy, CUTOFF)
    run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    ledger.record_error(conn, plan.run_key, plan.chunks[2].key, "lock timeout (SQLSTATE 55P03): boom", 1000)

    status = run_cli(capsys, *setup["args"], "status", "--as-of", "2024-07-01T12:00:00Z")
    # A chunk error while the run goes on (its retry may still come): a warning, exit 0.
    assert status.code == 0, status.err
    assert "events_purge" in status.out
    assert "1/4" in status.out and "running for" in status.out
    assert f"warning: run {plan.run_key}: chunk {plan.chunks[2].key} (pending): lock timeout" in status.out
    # No batch for 20 minutes, longer than any retry delay: the run stopped on it, the policy is failing.
    rows(
        admin,
        f"UPDATE \"{policy.ledger_schema}\".chunks SET last_batch_at = now() - interval '20 minutes'"
        + " WHERE last_batch_at IS NOT NULL",
    )
    stopped = run_cli(capsys, *setup["args"], "status", "--as-of", "2024-07-01T12:00:00Z")
    assert stopped.code == 3, stopped.err
    assert f"failing: run {plan.run_key}: chunk {plan.chunks[2].key} (pending): lock timeout" in stopped.out

    data = run_cli(capsys, *setup["args"], "--json", "status", "events_purge").json()
    (entry,) = data["policies"]
    (run,) = entry["runs"]
    assert run["run_key"] == plan.run_key
    assert (run["chunks_complete"], run["chunks_expected"], run["rows_deleted"]) == (1, 4, 300)
    assert (run["state"], run["running"], run["cleanup_lag_seconds"]) == ("planned", True, None)
    assert run["chunk_errors"] == [
        {
            "chunk_key": plan.chunks[2].key,
            "state": "pending",
            "last_error": "lock timeout (SQLSTATE 55P03): boom",
            "last_batch_at": None,
        }
    ]
    assert {w["kind"] for w in entry["warnings"]} >= {"chunk_error"}
    assert [w["kind"] for w in entry["failing"]] == ["chunk_error"] and data["failing"] is True

    verify = run_cli(capsys, *setup["args"], "verify", "events_purge", "--date", RUN_DATE)
    assert verify.code == 1
    assert f"run {plan.run_key}: 1 of 4 expected chunk(s) complete; missing:" in verify.out
    assert "boom" in verify.out and plan.chunks[3].key in verify.out

    follow = run_cli(capsys, *setup["args"], "status", "--follow", plan.run_key, "--iterations", "1")
    assert follow.code == 0, follow.err
    assert "chunks" in follow.out and "1/4" in follow.out and f"300/{plan.rows_planned}" in follow.out

    for chunk in plan.chunks[1:]:
        run_chunk(conn, policy, CUTOFF, chunk)
    ledger.complete_run(conn, plan.run_key, "test")
    # Complete, its cleanup lag not measured yet (a large run leaves it to the next run's planning).
    status = run_cli(capsys, *setup["args"], "status", "--as-of", "2024-07-01T12:00:00Z")
    assert "complete" in status.out and "at next run" in status.out
    measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=plan.run_key)

    verify = run_cli(capsys, *setup["args"], "--json", "verify", "events_purge", "--leftovers")
    assert verify.code == 0, verify.err
    data = verify.json()
    assert data["ok"] and data["state"] == "complete" and data["incomplete_chunks"] == []
    assert (data["chunks_expected"], data["chunks_complete"]) == (4, 4)
    assert data["rows_deleted"] == setup["eligible"]
    assert data["leftovers"] == {"count": 0, "capped": False, "oldest": None, "lag_seconds": 0.0}

    status = run_cli(capsys, *setup["args"], "status", "--as-of", "2024-07-01T12:00:00Z")
    assert "complete" in status.out and "4/4" in status.out and "0 s" in status.out
    assert status.out.count("warning:") == 0
    run = run_cli(capsys, *setup["args"], "--json", "status").json()["policies"][0]["runs"][0]
    assert (run["state"], run["running"], run["cleanup_lag_seconds"], run["eligible_left"]) == ("complete", False, 0, 0)


def test_watch_follows_a_purge_running_in_another_thread_until_done(
    capsys: Any, setup: dict[str, Any], conn: Any, dsn: str
) -> None:
    policy = setup["policy"]
    plan = plan_run(conn, policy, CUTOFF)
    started = threading.Event()

    def purge() -> None:
        import psycopg2

        worker = psycopg2.connect(dsn)
        try:
            started.set()
            for chunk in plan.chunks:
                run_chunk(worker, policy, CUTOFF, chunk)
        finally:
            worker.close()

    thread = threading.Thread(target=purge)
    thread.start()
    started.wait(10)
    result = run_cli(capsys, *setup["args"], "--json", "status", "--watch", "--interval", "0.05", "--iterations", "400")
    thread.join(60)
    assert result.code == 0, result.err
    import json

    lines = [json.loads(line) for line in result.out.splitlines()]
    last = lines[-1]["runs"]
    assert [r["run_key"] for r in last] == [plan.run_key]
    assert last[0]["done"] and last[0]["chunks_complete"] == 4 == last[0]["chunks_expected"]
    assert last[0]["rows_done"] == plan.rows_planned

    nothing = run_cli(capsys, *setup["args"], "status", "--watch")
    assert "no running purge" in nothing.out


def test_progress_of_counts_chunks_and_rows() -> None:
    run = {"run_key": "p@2024-06-01T12:00:00Z", "state": "planned", "chunks_expected": 3, "rows_planned": 90}
    chunk = {"rows_planned": 30, "rows_matched": 0, "last_error": None, "last_batch_at": None}
    chunks = [
        {**chunk, "chunk_key": "a", "state": "complete", "rows_deleted": 30},
        {**chunk, "chunk_key": "b", "state": "running", "rows_deleted": 12, "last_error": "lock timeout"},
        {**chunk, "chunk_key": "c", "state": "pending", "rows_deleted": 0},
    ]
    progress = progress_of(run, chunks)
    assert (progress.chunks_complete, progress.chunks_running, progress.chunks_expected) == (1, 1, 3)
    assert (progress.rows_done, progress.rows_planned, progress.done) == (42, 90, False)
    assert [e.chunk_key for e in progress.errors] == ["b"]
    dry = progress_of({**run, "run_key": "p@x#dry-run"}, [{**c, "rows_matched": 5} for c in chunks])
    assert dry.rows_done == 15


def test_missed_runs_and_stuck_runs_are_warned(capsys: Any, setup: dict[str, Any], conn: Any, admin: Any) -> None:
    policy = setup["policy"]
    ledger = Ledger(policy.ledger_schema)
    # Daily runs of 2024-07-01..05: the 1st, 2nd and 4th complete, the 3rd planned hours ago and left there.
    stuck = None
    for day in (1, 2, 3, 4):
        cutoff = datetime(2024, 6, day, tzinfo=timezone.utc)
        plan = plan_run(conn, policy, cutoff)
        if day == 3:
            stuck = plan
            continue
        for chunk in plan.chunks:
            run_chunk(conn, policy, cutoff, chunk)
        ledger.complete_run(conn, plan.run_key, "test")
    assert stuck is not None and stuck.chunks
    rows(
        admin,
        f"UPDATE \"{policy.ledger_schema}\".runs SET planned_at = now() - interval '3 hours 12 minutes'"
        " WHERE run_key = %(k)s",
        {"k": stuck.run_key},
    )
    path = write_policies(
        Path(setup["args"][1]), policy_data(policy.table.schema, chunk_rows=300, start_date="2024-07-01")
    )
    result = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "status", "--as-of", "2024-07-06T00:30:00Z")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    # The 3rd's run never completed, but the 4th's (a later cutoff) did: it deleted everything the 3rd's
    # would, so the 3rd needs no backfill. The 5th was never run: its run could still delete rows.
    assert (
        "1 scheduled run(s) without a complete run in the ledger that could still delete rows (1 never planned):"
        " 2024-07-05; backfill: airflow backfill create --dag-id retention_events_purge"
        " --from-date 2024-07-05T00:00:00Z --to-date 2024-07-05T00:00:00Z"
    ) in text
    assert (
        "1 scheduled day(s) from 2024-07-03 to 2024-07-03 have no complete run of their own, but the complete run"
        " with cutoff 2024-06-04 00:00:00Z already deleted what they would: nothing to backfill"
    ) in text
    assert f"run {stuck.run_key}: planned 3 h 12 min ago" in text

    data = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "--json", "status", "--as-of", "2024-07-06").json()
    missed = data["policies"][0]["missed_runs"]
    assert [(m["date"], m["in_ledger"], m["covered_by_cutoff"]) for m in missed] == [
        ("2024-07-05T00:00:00+00:00", False, None),
    ]
    assert missed[0]["run_key"] == "events_purge@2024-06-05T00:00:00Z"
    covered = data["policies"][0]["covered_runs"]
    assert [(m["date"], m["in_ledger"], m["covered_by_cutoff"]) for m in covered] == [
        ("2024-07-03T00:00:00+00:00", True, "2024-06-04T00:00:00+00:00"),
    ]
    kinds = [w["kind"] for w in data["policies"][0]["warnings"]]
    assert kinds == ["missed_run", "stuck"]

    # The database budget pauses every purge now (a standby's replay lag): the same run is held on purpose,
    # a warning naming why (one the latest run would not fail on: FAILING_KINDS).
    rows(
        admin,
        f'INSERT INTO "{policy.ledger_schema}".budget_state (scope, level, concurrency, duty, paused, reasons,'
        " observed_at) VALUES ('database', 5, 1, 1.0, true, ARRAY['replica_lag 45000ms > 30000ms'], clock_timestamp())"
        " ON CONFLICT (scope) DO UPDATE SET paused = true, reasons = EXCLUDED.reasons, observed_at = clock_timestamp()",
    )
    data = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "--json", "status", "--as-of", "2024-07-06").json()
    held = data["policies"][0]
    assert [w["kind"] for w in held["warnings"]] == ["missed_run", "throttled"]
    assert "the database budget is paused (replica_lag 45000ms > 30000ms)" in held["warnings"][1]["message"]
    assert "throttled" not in FAILING_KINDS
    # A pause nobody observed for over a minute holds nothing: stuck again.
    rows(
        admin,
        f"UPDATE \"{policy.ledger_schema}\".budget_state SET observed_at = clock_timestamp() - interval '5 min'",
    )
    data = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "--json", "status", "--as-of", "2024-07-06").json()
    assert [w["kind"] for w in data["policies"][0]["warnings"]] == ["missed_run", "stuck"]


def test_init_ledger_creates_then_reports_up_to_date(capsys: Any, schema: str, admin: Any) -> None:
    ledger_schema = f"{schema}_ledger"
    first = run_cli(capsys, "--dsn", DSN, "init-ledger", "--schema", ledger_schema)
    assert first.code == 0, first.err
    assert f"ledger schema {ledger_schema} in" in first.out and f"version {SCHEMA_VERSION} (created)" in first.out
    assert schema_exists(admin, ledger_schema)
    again = run_cli(capsys, "init-ledger", "--dsn", DSN, "--schema", ledger_schema, "--json").json()
    assert again == {
        "ledgers": [
            {
                "database": again["ledgers"][0]["database"],
                "schema": ledger_schema,
                "version_before": SCHEMA_VERSION,
                "version": SCHEMA_VERSION,
                "action": "up to date",
            }
        ]
    }
    assert "password" not in again["ledgers"][0]["database"]


def test_init_ledger_of_the_policies_through_their_airflow_connection(
    capsys: Any, setup: dict[str, Any], admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_retention.demo.postgres import airflow_connection_json

    monkeypatch.setenv("AIRFLOW_CONN_RETENTION_TARGET", airflow_connection_json(DSN))
    result = run_cli(capsys, "--policies", setup["args"][1], "init-ledger")
    assert result.code == 0, result.err
    assert schema_exists(admin, setup["policy"].ledger_schema)
    status = run_cli(capsys, "--policies", setup["args"][1], "status")
    assert "no run in the ledger yet" in status.out


def test_errors_are_one_line_with_exit_code_2(capsys: Any, setup: dict[str, Any], tmp_path: Path) -> None:
    unknown = run_cli(capsys, *setup["args"], "plan", "nope", "--date", RUN_DATE)
    assert unknown.code == 2
    assert unknown.err.strip() == "airflow-retention: error: unknown policy 'nope'; known policies: events_purge"

    nowhere = "postgresql://nobody@127.0.0.1:1/x"
    bad_db = run_cli(
        capsys, "--policies", setup["args"][1], "--dsn", nowhere, "plan", "events_purge", "--date", RUN_DATE
    )
    assert bad_db.code == 2
    assert bad_db.err.startswith("airflow-retention: error: cannot connect to PostgreSQL (")
    assert len(bad_db.err.strip().splitlines()) == 1 and "Traceback" not in bad_db.err
    # status reports an unreachable database as that policy failing (exit 3), in one line, and goes on.
    down = run_cli(capsys, "--policies", setup["args"][1], "--dsn", nowhere, "status")
    assert down.code == 3 and "Traceback" not in down.out + down.err
    assert "events_purge  failing: cannot connect to PostgreSQL (" in down.out

    no_file = run_cli(capsys, "--policies", str(tmp_path / "missing.yaml"), "--json", "status")
    assert no_file.code == 2 and "cannot read policies file" in no_file.err
    assert no_file.json()["exit_code"] == 2

    future = run_cli(capsys, *setup["args"], "plan", "events_purge", "--date", "2999-01-01")
    assert future.code == 2 and "is in the future" in future.err and "Traceback" not in future.err

    bad_date = run_cli(capsys, *setup["args"], "verify", "events_purge", "--date", "yesterday")
    assert bad_date.code == 2 and "--date 'yesterday' is not a date" in bad_date.err

    never = run_cli(capsys, *setup["args"], "verify", "events_purge", "--date", RUN_DATE)
    assert never.code == 1 and "not in the ledger (never planned)" in never.out


def test_unknown_policy_in_a_file_with_a_bad_policy_is_reported(capsys: Any, schema: str, tmp_path: Path) -> None:
    path = write_policies(tmp_path / "p.yaml", policy_data(schema), policy_data(schema, name="broken", retention="x"))
    result = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "status", "broken")
    # Named on the command line, an invalid policy is reported as invalid (exit 3), not as unknown.
    assert result.code == 3
    assert "policy 'broken'" in result.err and "skipped" in result.err
    assert "invalid policy: policy 'broken', field 'retention': cannot read 'x'" in " ".join(result.out.split())
    assert "events_purge" not in result.out
    unknown = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "status", "nope")
    assert unknown.code == 2 and "known policies: events_purge" in unknown.err


def test_verify_shows_rows_per_tenant_and_the_frozen_tenant_cutoffs(
    capsys: Any, admin: Any, schema: str, tmp_path: Path, conn: Any
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 3_000, tenant="1 + mod(g, 3)")
    data = policy_data(
        schema, chunk_by="block", tenant_column="tenant_id", tenant_retention={"2": "60 days"}, chunk_rows=1_000
    )
    path = write_policies(tmp_path / "policies.yaml", data)
    policy = make_policy(schema, **{k: v for k, v in data.items() if k not in ("name",)})
    plan = plan_run(conn, policy, CUTOFF)
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    per_tenant = dict(
        rows(
            admin,
            f'SELECT tenant, sum(rows_deleted)::bigint FROM "{schema}_ledger".tenant_counts GROUP BY 1',
        )
    )
    assert set(per_tenant) == {"1", "3"}  # tenant 2 keeps 60 days: none of its rows is old enough
    args = ["--policies", str(path), "--dsn", DSN, "verify", "events_purge", "--date", RUN_DATE]
    result = run_cli(capsys, *args, "--leftovers")
    assert result.code == 0, result.err
    assert "tenants with a retention of their own: 2 before 2024-05-02" in result.out
    assert f"rows deleted per tenant (2 tenant(s), {sum(per_tenant.values()):,} in all)" in result.out
    assert "no eligible row left before the cutoff" in result.out
    found = run_cli(capsys, "--json", *args).json()
    assert {t["tenant"]: t["rows_deleted"] for t in found["tenants"]} == per_tenant
    assert [(c["tenant"], c["source"]) for c in found["tenant_cutoffs"]] == [("2", "policy")]


def test_status_names_the_tenants_a_chunk_left_as_dead_letters(
    capsys: Any, admin: Any, schema: str, tmp_path: Path, conn: Any
) -> None:
    from airflow_retention.core.errors import PermanentError

    table = create_events(admin, schema)
    fill_events(admin, table, 2_000, tenant="1 + mod(g, 3)")
    rows(admin, f'CREATE TABLE "{schema}".orders (event_id bigint REFERENCES {table} (id))')
    rows(
        admin,
        f"INSERT INTO \"{schema}\".orders SELECT id FROM {table} WHERE tenant_id = 2 AND status <> 'open'"
        " AND created_at < %(c)s LIMIT 1",
        {"c": CUTOFF},
    )
    data = policy_data(schema, chunk_by="block", tenant_column="tenant_id", chunk_rows=100_000)
    path = write_policies(tmp_path / "policies.yaml", data)
    policy = make_policy(schema, chunk_by="block", tenant_column="tenant_id", chunk_rows=100_000)
    plan = plan_run(conn, policy, CUTOFF)
    with pytest.raises(PermanentError):
        run_chunk(conn, policy, plan.cutoff, plan.chunks[0])
    result = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "--json", "status", "events_purge")
    warnings = [w for p in result.json()["policies"] for w in p["warnings"] if w["kind"] == "dead_letter"]
    assert len(warnings) == 1 and "tenant 2 of blocks:" in warnings[0]["message"]
    assert "foreign key violation: rows of table orders still reference them" in warnings[0]["message"]


def test_verify_says_which_tenant_a_packed_key_chunk_is_at(
    capsys: Any, admin: Any, schema: str, tmp_path: Path, conn: Any
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 3_000, tenant="1 + mod(g, 4)")
    data = policy_data(schema, chunk_by="key", tenant_column="tenant_id", chunk_rows=100_000, batch_size=100)
    data["target_batch_time"] = 0
    path = write_policies(tmp_path / "policies.yaml", data)
    policy = make_policy(schema, **{k: v for k, v in data.items() if k != "name"})
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    assert chunk.tenants == ("1", "2", "3", "4")

    class Stop(Exception):
        pass

    def stop_in_the_third_tenant(report: Any) -> None:
        if report.tenant == "3":
            raise Stop

    with pytest.raises(Stop):
        run_chunk(conn, policy, plan.cutoff, chunk, on_batch=stop_in_the_third_tenant)
    next_key = scalar(admin, f'SELECT next_key FROM "{schema}_ledger".chunks')
    result = run_cli(capsys, "--policies", str(path), "--dsn", DSN, "verify", "events_purge", "--date", RUN_DATE)
    assert result.code == 1, result.err
    assert f"tenant 3 (3 of 4) · {next_key:,}" in result.out


def test_plan_freezes_tenant_cutoffs_from_the_date_given(capsys: Any, admin: Any, schema: str, tmp_path: Path) -> None:
    """``--date 2026-03-31`` with ``retention: 1 month`` (cutoff 02-28): tenant 1's "7 days" is frozen
    from 03-31 itself (03-24), not from a date rebuilt from the cutoff (03-28, giving 03-21). Given only
    the cutoff 02-28, which the runs of 03-28 to 03-31 share, the command asks for the date."""
    table = create_events(admin, schema)
    fill_events(admin, table, 200)
    data = policy_data(schema, retention="1 month", tenant_column="tenant_id", tenant_retention={1: "7 days"})
    args = ["--policies", str(write_policies(tmp_path / "policies.yaml", data)), "--dsn", DSN, "plan", "events_purge"]
    found = run_cli(capsys, *args, "--date", "2026-03-31", "--json").json()
    assert found["cutoff"] == "2026-02-28T00:00:00+00:00"
    assert [(t["tenant"], t["cutoff"]) for t in found["tenant_cutoffs"]] == [("1", "2026-03-24T00:00:00+00:00")]
    refused = run_cli(capsys, *args, "--cutoff", "2026-02-28T00:00:00Z")
    assert refused.code == 2 and "--date" in refused.err and "does not tell it" in refused.err


def test_status_exits_3_for_an_invalid_policy_or_a_missing_table_and_reports_the_others(
    capsys: Any, setup: dict[str, Any], admin: Any, schema: str
) -> None:
    """One healthy policy beside a typo and a policy whose table is not in the database: each failing one
    is named with its problem, the healthy one is reported as usual, the exit code is 3; no ledger schema
    is created by looking, and a plan of the missing table names the database and creates none either."""
    path = Path(setup["args"][1])
    ghost_ledger = f"{schema}_ghost_ledger"
    write_policies(
        path,
        policy_data(schema, chunk_rows=300),
        policy_data(schema, name="ghost", table=f"{schema}.ghost", ledger_schema=ghost_ledger),
        policy_data(schema, name="typo", conditon="true"),
    )
    healthy = run_cli(capsys, *setup["args"], "status", "events_purge")
    assert healthy.code == 0, healthy.out + healthy.err

    result = run_cli(capsys, *setup["args"], "status")
    assert result.code == 3, result.out + result.err
    text = " ".join(result.out.split())
    database = scalar(admin, "SELECT current_database()")
    assert (
        f"failing: the next plan fails: policy 'ghost': table {schema}.ghost does not exist in database"
        f" {database!r} of connection 'retention_target' (or this role cannot see it)"
    ) in text
    assert "invalid policy: policy 'typo', field 'conditon': unknown key" in text
    assert "events_purge" in text and "failing: run" not in text

    data = run_cli(capsys, *setup["args"], "--json", "status").json()
    assert data["failing"] is True
    assert [i["policy"] for i in data["invalid_policies"]] == ["typo"]
    by_name = {p["policy"]: p for p in data["policies"]}
    assert by_name["events_purge"]["failing"] == []
    assert [w["kind"] for w in by_name["ghost"]["failing"]] == ["target"]
    assert not schema_exists(admin, ghost_ledger)

    plan = run_cli(capsys, *setup["args"], "plan", "ghost", "--date", RUN_DATE)
    assert plan.code == 2 and f"does not exist in database {database!r}" in plan.err
    conn = psycopg2.connect(DSN)
    try:
        ghost = make_policy(schema, name="ghost", table=f"{schema}.ghost", ledger_schema=ghost_ledger)
        with pytest.raises(Exception, match=f"does not exist in database {database!r}"):
            plan_run(conn, ghost, CUTOFF)
    finally:
        conn.close()
    assert not schema_exists(admin, ghost_ledger)


def test_status_reports_a_policy_whose_ledger_cannot_be_read_and_goes_on(
    capsys: Any, setup: dict[str, Any], admin: Any, schema: str
) -> None:
    """An error reading one policy's ledger (here a broken ledger schema) fails that policy, in one line;
    the policy beside it on the same database is still reported."""
    broken = f"{schema}_broken"
    rows(admin, f'CREATE SCHEMA "{broken}"')
    rows(admin, f'CREATE TABLE "{broken}".ledger_version (version integer)')
    rows(admin, f'INSERT INTO "{broken}".ledger_version VALUES (5)')  # v5, without its tables
    path = Path(setup["args"][1])
    write_policies(path, policy_data(schema, name="broken", ledger_schema=broken), policy_data(schema, chunk_rows=300))
    result = run_cli(capsys, *setup["args"], "status")
    assert result.code == 3, result.out + result.err
    text = " ".join(result.out.split())
    assert f"broken failing: cannot read its ledger in schema '{broken}':" in text
    assert "events_purge" in text and "Traceback" not in result.out + result.err


def test_plan_verify_and_status_say_which_leaves_a_run_left_past_the_chunk_budget(
    capsys: Any, admin: Any, schema: str, tmp_path: Path, conn: Any
) -> None:
    """A partitioned table with more leaves to purge than the chunk budget: the plan preview warns, and the
    verify and the status of a run done with leaves left out never call it plainly complete (exit 0 all
    the same: its planned chunks are all it will do, and the next run plans those leaves first)."""
    from ..core.partition_helpers import create_hashed, insert_night

    table = create_hashed(admin, schema)
    insert_night(admin, table, 0, CUTOFF)
    data = policy_data(schema, table=f"{schema}.t", chunk_by="block", key_column=None, condition=None)
    args = ["--policies", str(write_policies(tmp_path / "policies.yaml", data)), "--dsn", DSN]
    left = f"{schema}.t_h2, {schema}.t_h3"
    said = (
        "2 leaf partition(s) with eligible rows not covered by this run (past the chunk budget of 2;"
        f" max_map_length): {left}"
    )

    preview = run_cli(capsys, *args, "plan", "events_purge", "--date", RUN_DATE, "--max-chunks", "2")
    assert preview.code == 0, preview.err
    assert f"warning: {said}" in " ".join(preview.out.split())
    found = run_cli(capsys, *args, "plan", "events_purge", "--date", RUN_DATE, "--max-chunks", "2", "--json").json()
    assert found["leaves_deferred"] == [f"{schema}.t_h2", f"{schema}.t_h3"]

    policy = RetentionPolicy.from_dict(data)
    plan = plan_run(conn, policy, CUTOFF, max_chunks=2)
    for chunk in plan.chunks:
        run_chunk(conn, policy, CUTOFF, chunk)
    Ledger(policy.ledger_schema).complete_run(conn, plan.run_key, "test")

    verify = run_cli(capsys, *args, "verify", "events_purge", "--date", RUN_DATE)
    assert verify.code == 0, verify.err
    text = " ".join(verify.out.split())
    assert "all 2 planned chunk(s) complete" in text and said in text and "the next run plans them first" in text
    result = run_cli(capsys, *args, "--json", "verify", "events_purge", "--date", RUN_DATE).json()
    assert result["ok"] is True and result["leaves_deferred"] == [f"{schema}.t_h2", f"{schema}.t_h3"]

    status = run_cli(capsys, *args, "status", "--as-of", "2024-07-01T12:00:00Z")
    assert status.code == 0, status.err
    assert f"warning: run {plan.run_key}: {said}" in " ".join(status.out.split())
    (entry,) = run_cli(capsys, *args, "--json", "status", "--as-of", "2024-07-01T12:00:00Z").json()["policies"]
    (run,) = entry["runs"]
    assert run["status"] == "complete, 2 leaf partition(s) not covered"
    assert run["leaves_deferred"] == [f"{schema}.t_h2", f"{schema}.t_h3"]
    assert [w["kind"] for w in entry["warnings"]] == ["leaves_deferred"] and entry["failing"] == []


def test_status_shows_the_budget_the_pauses_per_reason_and_the_cleanup_slo(
    capsys: Any, setup: dict[str, Any], conn: Any, admin: Any, schema: str, tmp_path: Path
) -> None:
    """Beside the runs: the database budget's state, the latest run's pauses by reason and the cleanup SLO,
    in text and in --json; the SLO's warnings (at risk, exhausted budget) are warnings, not failures."""
    # A duty cycle of 5 %, below the budget's slow start (10 %, beside the other tests' sessions): every batch
    # rests 19 times as long as it ran, recorded as paused for max_duty_cycle.
    fields = {"chunk_rows": 300, "max_duty_cycle": 0.05, "budget": True}
    path = write_policies(tmp_path / "duty.yaml", policy_data(schema, **fields))
    args = ["--policies", str(path), "--dsn", DSN]
    policy = make_policy(schema, **fields)
    ledger = Ledger(policy.ledger_schema)
    plan = plan_run(conn, policy, CUTOFF)
    for chunk in plan.chunks:
        run_chunk(conn, policy, CUTOFF, chunk)
    ledger.complete_run(conn, plan.run_key, "test")
    measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=plan.run_key)
    s = f'"{policy.ledger_schema}"'
    paused = {
        reason: float(seconds)
        for reason, seconds in rows(
            admin,
            f"SELECT d.key, sum(d.value::float8) FROM {s}.chunks c, jsonb_each_text(c.paused) d"
            " WHERE c.run_key = %(k)s GROUP BY d.key",
            {"k": plan.run_key},
        )
    }
    assert paused.get("max_duty_cycle", 0) > 0, paused
    ((concurrency, duty, level),) = rows(admin, f"SELECT concurrency, duty, level FROM {s}.budget_state")

    status = run_cli(capsys, *args, "status", "--as-of", "2024-07-01T12:00:00Z")
    assert status.code == 0, status.err
    text = " ".join(status.out.split())
    assert f"database budget: {concurrency} batch(es) at once, busy {duty:.0%} (level {level})" in text, text
    assert f"run {plan.run_key} paused: max_duty_cycle" in text
    assert f"cleanup SLO: λ {setup['eligible']:,} rows/day" in text and "keeps up" in text
    assert "warning:" not in text
    data = run_cli(capsys, *args, "--json", "status", "--as-of", "2024-07-01T12:00:00Z").json()
    (entry,) = data["policies"]
    assert entry["budget"]["observed"] is True and entry["budget"]["enabled"] is True
    assert (entry["budget"]["concurrency"], entry["budget"]["duty"], entry["budget"]["level"]) == (
        concurrency,
        duty,
        level,
    )
    assert entry["budget"]["state"] == f"{concurrency} batch(es) at once, busy {duty:.0%}"
    assert entry["paused_seconds"]["run_key"] == plan.run_key
    assert entry["paused_seconds"]["by_reason"] == pytest.approx(paused, abs=1e-3)
    slo = entry["slo"]
    assert slo["keeps_up"] is True and slo["warnings"] == [] and slo["runs"] == 1
    assert slo["lambda_rows_per_day"] == setup["eligible"] and slo["backlog_rows"] == 0
    assert slo["concurrency"] <= 0.5 and slo["mu_rows_per_s"] > 0

    # The budget paused on a standby's lag, held at its floor through the run, and a backlog no window holds.
    rows(
        admin,
        f"UPDATE {s}.budget_state SET paused = true, reasons = ARRAY['replica_lag 40000ms > 30000ms'],"
        " causes = ARRAY['replica_lag']",
    )
    rows(
        admin,
        f"UPDATE {s}.budget_observations SET level = %(l)s, duty = %(d)s,"
        " reasons = ARRAY['canary_latency 9.0 ms > 3.0 ms (baseline 1.0 ms)']",
        {"l": FLOOR_LEVEL, "d": FLOOR_DUTY},
    )
    rows(admin, f"UPDATE {s}.runs SET eligible_left = 1000000000000 WHERE run_key = %(k)s", {"k": plan.run_key})
    status = run_cli(capsys, *args, "status", "--as-of", "2024-07-01T12:00:00Z")
    assert status.code == 0, status.err  # warnings, not failures
    text = " ".join(status.out.split())
    assert f"database budget: paused (level {level}), paused by: replica_lag 40000ms > 30000ms" in text, text
    assert "warning: cleanup SLO at risk: c*mu = " in text
    assert "plus a backlog of 1,000,000,000,000 row(s) within the cleanup window 1 day" in text
    # The policy's own duty cycle is no reason of the budget's.
    assert (
        "warning: exhausted database budget: held at its floor for 100% of the last run (reasons: canary_latency)"
        in text
    )
    assert "failing:" not in text
    data = run_cli(capsys, *args, "--json", "status", "--as-of", "2024-07-01T12:00:00Z").json()
    (entry,) = data["policies"]
    assert {w["kind"] for w in entry["warnings"]} == {"slo_at_risk", "budget_exhausted"}
    assert entry["failing"] == [] and data["failing"] is False
    assert entry["budget"]["paused"] is True and entry["budget"]["causes"] == ["replica_lag"]
    assert entry["slo"]["keeps_up"] is False and entry["slo"]["floor_share"] == 1.0
