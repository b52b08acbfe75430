"""What users do with a running Airflow 3: the scheduler's own runs, backfills through the REST API as
the UI makes them, and a pipeline that reuses the retention pieces, all asserted on the tables and the
ledger. Run alone with ``pytest -m scheduler``."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.seed import snapshot
from tests.deployment.conftest import ARTIFACTS, day, one
from tests.deployment.harness import TEST_TIMEOUT, Deployment, budget

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

LEDGER = Ledger("retention")


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def ledger_run(conn: Any, policy: RetentionPolicy, logical_date: datetime) -> dict[str, Any] | None:
    return LEDGER.get_run(conn, run_key(policy, freeze_cutoff(policy, logical_date)))


def finished(runs: list[dict[str, Any]], count: int) -> bool:
    return len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs)


def test_the_provider_is_registered_and_the_dags_parse(deployment: Deployment) -> None:
    providers = {p["package_name"] for p in deployment.api("GET", "/providers")["providers"]}
    assert "airflow-retention" in providers
    for dag_id in (
        "retention_webhook_deliveries",
        "retention_tenant_events",
        "retention_audit_log",
        "retention_api_requests",
        "example_nightly_maintenance",
    ):
        assert deployment.wait_for_dag(dag_id)["is_paused"] is True
    assert deployment.api("GET", "/importErrors")["total_entries"] == 0


@pytest.mark.oldest
def test_the_scheduler_creates_and_runs_the_scheduled_runs(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    policy = policy_map["webhook_deliveries"]
    before = snapshot(target, policy, freeze_cutoff(policy, day(0)))
    deployment.wait_for_dag("retention_webhook_deliveries")
    deployment.unpause("retention_webhook_deliveries")
    # catchup from two days ago: the scheduler itself creates a run per day, one at a time.
    runs = deployment.wait_for_runs("retention_webhook_deliveries", lambda rs: finished(rs, 3), timeout=budget(60))
    assert [r["run_type"] for r in runs] == ["scheduled"] * 3
    assert [r["state"] for r in runs] == ["success"] * 3
    assert [r["logical_date"][:10] for r in runs] == [d.date().isoformat() for d in (day(-2), day(-1), day(0))]
    for r in runs:
        run = ledger_run(target, policy, datetime.fromisoformat(r["logical_date"].replace("Z", "+00:00")))
        assert run is not None and run["state"] == "complete"
        assert run["chunks_completed"] == run["chunks_expected"]
    after = snapshot(target, policy, freeze_cutoff(policy, day(0)))
    assert after.eligible == 0
    assert (after.total, after.keep_checksum) == (before.keep_count, before.keep_checksum)
    assert before.eligible > 0
    deployment.pause("retention_webhook_deliveries")


def backfill(deployment: Deployment, dag_id: str, start: datetime, end: datetime, reprocess: str) -> dict[str, Any]:
    """Create a backfill exactly as the UI's dialog does: POST /api/v2/backfills, as the logged-in user."""
    created = deployment.api(
        "POST",
        "/backfills",
        json={
            "dag_id": dag_id,
            "from_date": iso(start),
            "to_date": iso(end),
            "run_backwards": False,
            "dag_run_conf": {},
            "reprocess_behavior": reprocess,
            "max_active_runs": 1,
        },
    )
    return deployment.wait_until(
        lambda: (b := deployment.api("GET", f"/backfills/{created['id']}"))["completed_at"] and b,
        timeout=budget(75),
        what=f"backfill {created['id']} of {dag_id}",
    )


@pytest.mark.oldest
def test_backfills_through_the_rest_api_with_reprocess_behaviours(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    dag_id = "retention_tenant_events"
    policy = policy_map["tenant_events"]
    # The scheduler's latest run is today's, or tomorrow's if the test crosses midnight UTC: what each
    # would keep, taken before anything runs; the run's own date picks one.
    befores = {d: snapshot(target, policy, freeze_cutoff(policy, d)) for d in (day(0), day(1))}
    deployment.wait_for_dag(dag_id)
    deployment.unpause(dag_id)
    # catchup off: unpausing creates only the latest run.
    (scheduled,) = deployment.wait_for_runs(dag_id, lambda rs: finished(rs, 1), timeout=budget(45))
    assert (scheduled["run_type"], scheduled["state"]) == ("scheduled", "success")
    (run_day,) = [d for d in befores if d.date().isoformat() == scheduled["logical_date"][:10]]
    latest, before = freeze_cutoff(policy, run_day), befores[run_day]
    # The DAG stays unpaused: Airflow does not run the backfill runs of a paused DAG.

    # Three missed days; their cutoffs are older than the latest run's, so they find nothing left.
    backfill(deployment, dag_id, day(-6), day(-4), "none")
    runs = {r["logical_date"][:10]: r for r in deployment.runs(dag_id)}
    for d in (day(-6), day(-5), day(-4)):
        assert runs[d.date().isoformat()]["run_type"] == "backfill"
        assert runs[d.date().isoformat()]["state"] == "success"
        run = ledger_run(target, policy, d)
        assert run is not None and run["state"] == "complete" and run["rows_deleted"] == 0

    # An overlapping range with "none": only the day without a run is created.
    count = len(deployment.runs(dag_id))
    backfill(deployment, dag_id, day(-5), day(-3), "none")
    assert len(deployment.runs(dag_id)) == count + 1
    assert ledger_run(target, policy, day(-3))["state"] == "complete"

    # "completed": the completed days run again; the ledger makes that harmless.
    chunks_before = LEDGER.chunk_rows(target, run_key(policy, latest))
    starts = {r["logical_date"][:10]: r["start_date"] for r in deployment.runs(dag_id)}
    backfill(deployment, dag_id, day(-5), day(-4), "completed")
    rerun = {r["logical_date"][:10]: r for r in deployment.runs(dag_id)}
    for d in (day(-5), day(-4)):
        assert rerun[d.date().isoformat()]["state"] == "success"
        assert rerun[d.date().isoformat()]["start_date"] != starts[d.date().isoformat()]
    assert LEDGER.chunk_rows(target, run_key(policy, latest)) == chunks_before
    after = snapshot(target, policy, latest)
    assert after.eligible == 0
    assert (after.total, after.keep_checksum) == (before.keep_count, before.keep_checksum)


def test_a_backfill_created_in_the_ui_and_one_from_the_cli(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    from playwright.sync_api import sync_playwright

    from tests.deployment import ui

    dag_id = "retention_audit_log"
    policy = policy_map["audit_log"]
    missed = day(-4)
    assert snapshot(target, policy, freeze_cutoff(policy, missed)).eligible > 0
    deployment.wait_for_dag(dag_id)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = ui.launch_browser(p)
        try:
            page = ui.new_page(browser)
            ui.login(page, deployment.base_url, "admin", deployment.admin_password)
            # The DAG is paused: the dialog's "Unpause on trigger" box is ticked, as a user leaves it.
            created = ui.create_backfill(
                page,
                deployment.base_url,
                dag_id,
                missed.date().isoformat(),
                missed.date().isoformat(),
                reprocess="none",
            )
            assert created.expected_runs == 1
            (run,) = ui.wait_for_runs(page, deployment.base_url, dag_id, 1, budget(75), backfill=created)
            ui.screenshot_grid(page, deployment.base_url, dag_id, str(ARTIFACTS / "ui-backfill-grid.png"))
        finally:
            browser.close()
    assert (run["run_type"], run["state"], run["logical_date"][:10]) == (
        "backfill",
        "success",
        missed.date().isoformat(),
    )
    assert run["triggering_user_name"] == "admin"
    # Unpausing also let the scheduler create today's run, whose later cutoff may have taken the rows
    # first: either way the missed day's run is complete and nothing eligible at its cutoff is left.
    ledger = ledger_run(target, policy, missed)
    assert ledger is not None and ledger["state"] == "complete"
    assert snapshot(target, policy, freeze_cutoff(policy, missed)).eligible == 0
    assert ARTIFACTS.joinpath("ui-backfill-grid.png").stat().st_size > 10_000

    # The same from the command line, for the next missed day.
    cli_day = day(-3)
    out = deployment.airflow(
        "backfill",
        "create",
        "--dag-id",
        dag_id,
        "--from-date",
        cli_day.date().isoformat(),
        "--to-date",
        cli_day.date().isoformat(),
        "--reprocess-behavior",
        "none",
    )
    assert out.returncode == 0, out.stderr
    deployment.wait_until(
        lambda: (r := ledger_run(target, policy, cli_day)) is not None and r["state"] == "complete",
        timeout=budget(45),
        what="the CLI backfill's run to complete in the ledger",
    )
    runs = {r["logical_date"][:10]: r for r in deployment.runs(dag_id)}
    assert runs[cli_day.date().isoformat()]["run_type"] == "backfill"


def test_a_pipeline_reusing_the_task_group_and_a_lone_chunk(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    dag_id = "example_nightly_maintenance"
    deployment.wait_for_dag(dag_id)
    deployment.unpause(dag_id)
    logical = day(-1)
    deployment.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": iso(logical)})
    (run,) = deployment.wait_for_runs(dag_id, lambda rs: finished(rs, 1), timeout=budget(45))
    assert run["state"] == "success"
    states = {
        ti["task_id"]: ti["state"]
        for ti in deployment.api("GET", f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
    }
    assert states["export_daily_report"] == states["purge_audit_log.verify"] == "success"
    assert states["purge_old_webhooks"] == states["notify"] == "success"
    audit = policy_map["audit_log"]
    assert ledger_run(target, audit, logical)["state"] == "complete"
    assert snapshot(target, audit, freeze_cutoff(audit, logical)).eligible == 0
    webhooks = policy_map["webhook_deliveries"]
    lone = LEDGER.get_run(target, run_key(webhooks, freeze_cutoff(webhooks, logical), lone=True))
    assert lone is not None
    (chunk,) = LEDGER.chunk_rows(target, lone["run_key"])
    assert chunk["state"] == "complete" and chunk["completed_dag_id"] == dag_id


def test_a_partitioned_table_drops_its_expired_months_under_the_scheduler(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    dag_id = "retention_api_requests"
    policy = policy_map["api_requests"]
    cutoff = freeze_cutoff(policy, day(0))
    before = snapshot(target, policy, cutoff)
    months = "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_partition_tree('public.api_requests') t"
    months += " JOIN pg_class c ON c.oid = t.relid WHERE t.level = 1 ORDER BY 1"
    with target.cursor() as cur:
        cur.execute(months)
        attached = [r[0] for r in cur.fetchall()]
        # The months whose whole range ends by the cutoff, by the tests' own arithmetic.
        cur.execute(
            "SELECT c.relname, (SELECT count(*) FROM public.api_requests r WHERE r.tableoid = c.oid)"
            " FROM pg_partition_tree('public.api_requests') t JOIN pg_class c ON c.oid = t.relid"
            " WHERE t.level = 1 AND substring(pg_get_expr(c.relpartbound, c.oid) from 'TO \\(''([^'']+)''\\)')"
            "::timestamptz <= %s",
            (cutoff,),
        )
        expired = dict(cur.fetchall())
    assert expired and len(expired) < len(attached) and before.eligible > sum(expired.values())
    deployment.wait_for_dag(dag_id)
    deployment.unpause(dag_id)
    # catchup off: unpausing creates the latest scheduled run (logical date today).
    (scheduled,) = deployment.wait_for_runs(dag_id, lambda rs: finished(rs, 1), timeout=budget(45))
    deployment.pause(dag_id)
    assert (scheduled["run_type"], scheduled["state"]) == ("scheduled", "success")
    with target.cursor() as cur:
        cur.execute(months)
        assert [r[0] for r in cur.fetchall()] == [m for m in attached if m not in expired]
        cur.execute("SELECT count(*) FROM pg_class WHERE relname = ANY(%s)", (list(expired),))
        assert cur.fetchone()[0] == 0  # dropped, not only detached
    run = ledger_run(target, policy, day(0))
    assert run is not None and run["state"] == "complete" and run["rows_deleted"] == before.eligible
    chunks = {c["chunk_key"]: c for c in LEDGER.chunk_rows(target, run["run_key"])}
    for month, count in expired.items():
        chunk = chunks[f"drop:public.{month}"]
        assert (chunk["outcome"], chunk["rows_deleted"]) == ("dropped", count)
    after = snapshot(target, policy, cutoff)
    assert after.eligible == 0
    assert (after.total, after.keep_checksum) == (before.keep_count, before.keep_checksum)


ISOLATION_TABLES = """
CREATE SCHEMA IF NOT EXISTS isolation;
DROP TABLE IF EXISTS isolation.good, isolation.typo;
CREATE TABLE isolation.good (id bigint PRIMARY KEY, created_at timestamptz NOT NULL);
CREATE TABLE isolation.typo (LIKE isolation.good INCLUDING ALL);
INSERT INTO isolation.good SELECT n, now() - (n % 2) * interval '5 days' FROM generate_series(1, 200) n;
INSERT INTO isolation.typo SELECT * FROM isolation.good;
"""


@pytest.mark.oldest
def test_a_typo_in_one_policy_leaves_the_other_policies_running(
    deployment: Deployment, target: Any, policies: Path
) -> None:
    """Issue 22: under the real dag-processor an import error makes every DAG of the file stale, so a bad
    policy must never be one. Two policies are added to the file; a typo in one leaves the other active and
    triggerable through the REST API, the bad one shows its error as a DAG of its own (its run fails at
    once), no import error is recorded; fixing the typo brings the policy's own DAG back."""
    original = policies.read_text()
    doc = yaml.safe_load(original)
    common = {"key_column": "id", "timestamp_column": "created_at", "retention": "1 day", "schedule": None}
    doc["policies"] += [
        {"name": "iso_good", "table": "isolation.good", **common},
        {"name": "iso_typo", "table": "isolation.typo", "condition": "id > 0", **common},
    ]
    valid = yaml.safe_dump(doc, sort_keys=False)
    typo = valid.replace("condition: id > 0", "conditon: id > 0")
    assert typo.count("conditon:") == 1
    good, bad = "retention_iso_good", "retention_iso_typo"
    where = "policy 'iso_typo', field 'conditon'"

    def dag(dag_id: str) -> dict[str, Any] | None:
        """The DAG as the REST API shows it, if it is known and not stale."""
        try:
            found = deployment.api("GET", f"/dags/{dag_id}")
        except RuntimeError:  # 404: not parsed yet
            return None
        return None if found["is_stale"] else found

    def tags(found: dict[str, Any]) -> set[str]:
        return {t["name"] for t in found["tags"]}

    def import_errors() -> list[dict[str, Any]]:
        return [e for e in deployment.api("GET", "/importErrors")["import_errors"] if "retention_dags" in e["filename"]]

    with target.cursor() as cur:
        cur.execute(ISOLATION_TABLES)
    try:
        policies.write_text(valid)
        for dag_id in (good, bad):
            deployment.wait_until(lambda d=dag_id: dag(d), budget(15), f"{dag_id} to be parsed")

        policies.write_text(typo)
        # The next parse either shows the bad policy's own DAG or (the old behaviour) an import error.
        shown = deployment.wait_until(
            lambda: import_errors() or ((b := dag(bad)) and "invalid" in tags(b) and b),
            budget(15),
            f"the dag-processor to re-parse the typo of {bad}",
        )
        assert import_errors() == [], shown
        assert where in shown["description"]
        # Its doc and its tasks come from the new serialized version, which may follow a moment later (and the
        # api-server re-reads it only every [core] min_serialized_dag_fetch_interval on Airflow 3.0).
        deployment.wait_until(
            lambda: (
                where in (deployment.api("GET", f"/dags/{bad}/details")["doc_md"] or "")
                and [t["task_id"] for t in deployment.api("GET", f"/dags/{bad}/tasks")["tasks"]] == ["policy_error"]
            ),
            budget(10),
            f"the doc and the task of {bad} to show the typo",
        )
        assert (found := dag(good)) is not None and "invalid" not in tags(found)

        # The good policy's DAG still runs (a manual run through the REST API); the bad one's run fails at once.
        for dag_id in (good, bad):
            deployment.unpause(dag_id)
            deployment.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": iso(day(0))})
        for dag_id, state in ((good, "success"), (bad, "failed")):
            (run,) = deployment.wait_for_runs(dag_id, lambda rs: finished(rs, 1), timeout=budget(45))
            assert run["state"] == state, run
        assert one(target, "SELECT count(*) FILTER (WHERE id % 2 = 1), count(*) FROM isolation.good") == (0, 100)
        (ti,) = deployment.api("GET", f"/dags/{bad}/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
        assert (ti["task_id"], ti["state"], ti["try_number"]) == ("policy_error", "failed", 1)
        logs = deployment.api("GET", f"/dags/{bad}/dagRuns/{run['dag_run_id']}/taskInstances/policy_error/logs/1")
        assert where in str(logs)

        policies.write_text(valid)
        fixed = deployment.wait_until(
            lambda: (b := dag(bad)) and "invalid" not in tags(b) and b, budget(15), f"{bad} to be fixed"
        )
        assert fixed["description"] == "Delete rows of isolation.typo older than 1 day"
        assert import_errors() == []
    finally:
        policies.write_text(original)
        for dag_id in (good, bad):
            if dag(dag_id):
                deployment.pause(dag_id)
