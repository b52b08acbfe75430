"""The recovery drill under the real scheduler: 10 tenants x 4 chunks x 5,000 rows, four chunk tasks
at once, one worker SIGKILLed halfway through a chunk two thirds into the plan. Only that chunk is
repeated, from its last committed batch; completed chunks stay complete; the table ends as an undisturbed
run leaves it. (10 chunks per tenant took 277 s of the suite on a slow disk; 40 chunk tasks show the same.)"""

from __future__ import annotations

import os
import signal
from datetime import datetime, timezone
from typing import Any

import psycopg2
import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.model import RetentionPolicy
from tests.deployment.conftest import day, one
from tests.deployment.harness import TEST_TIMEOUT, Deployment, budget, tcp_client_ports

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

TENANTS, CHUNKS_PER_TENANT, ROWS_PER_CHUNK = 10, 4, 5_000
ELIGIBLE = TENANTS * CHUNKS_PER_TENANT * ROWS_PER_CHUNK
# Ids 1..210,000: tenant = id mod 10; one row in 21 is fresh (after the cutoff), the others are eligible.
TABLE_SQL = """
DROP SCHEMA IF EXISTS drill CASCADE;
CREATE SCHEMA drill;
CREATE TABLE drill.events (
    id bigint PRIMARY KEY, tenant_id integer NOT NULL, created_at timestamptz NOT NULL, payload text NOT NULL
);
INSERT INTO drill.events
SELECT g, g %% 10,
       CASE WHEN g %% 21 = 0 THEN %(cutoff)s::timestamptz + interval '1 hour'
            ELSE %(cutoff)s::timestamptz - make_interval(secs => 1 + g %% 86400) END,
       md5(g::text)
FROM generate_series(1, 210000) g;
CREATE INDEX ON drill.events (created_at);
CREATE INDEX ON drill.events (tenant_id, id);
ANALYZE drill.events;
"""
KEEP_SQL = "SELECT count(*), coalesce(sum(hashtextextended(id::text, 0)::numeric), 0) FROM drill.events"


def test_a_worker_killed_halfway_repeats_only_its_chunk_from_its_last_batch(
    deployment: Deployment, target: Any, policy_map: dict[str, RetentionPolicy]
) -> None:
    policy = policy_map["drill_events"]
    logical = day(0)
    cutoff = freeze_cutoff(policy, logical)
    with target.cursor() as cur:
        cur.execute(TABLE_SQL, {"cutoff": cutoff})
    # What an undisturbed run leaves: exactly the fresh rows.
    expected_keep = one(target, KEEP_SQL + " WHERE created_at >= %s", (cutoff,))
    assert one(target, "SELECT count(*) FROM drill.events WHERE created_at < %s", (cutoff,))[0] == ELIGIBLE

    dag_id = "retention_drill_events"
    deployment.wait_for_dag(dag_id)
    deployment.unpause(dag_id)
    ledger = Ledger(policy.ledger_schema)
    key = run_key(policy, cutoff)
    blocker = psycopg2.connect(target.dsn)
    try:
        deployment.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": logical.strftime("%Y-%m-%dT%H:%M:%SZ")})
        chunks = deployment.wait_until(
            lambda: ledger.version(target) and ledger.chunk_rows(target, key), budget(30), "the plan in the ledger"
        )
        assert len(chunks) == TENANTS * CHUNKS_PER_TENANT
        # Two thirds into the plan: a chunk not started yet, with most of those before it complete. Hold a
        # row of its third batch so that the worker commits two batches, then waits inside the third one
        # when we kill it.
        victim = next(c for c in chunks[2 * len(chunks) // 3 :] if c["state"] == "pending")
        # A batch is the next 1,000 keys of the tenant's range: the third holds keys 2,001 to 3,000.
        (third_batch_row,) = one(
            target,
            "SELECT id FROM (SELECT id, created_at FROM drill.events WHERE tenant_id = %s AND id >= %s AND id < %s"
            " ORDER BY id OFFSET 2000 LIMIT 1000) third WHERE created_at < %s ORDER BY id LIMIT 1",
            (int(victim["tenants"][0]), victim["lo"], victim["hi"], cutoff),
        )
        with blocker.cursor() as cur:
            cur.execute("SELECT 1 FROM drill.events WHERE id = %s FOR UPDATE", (third_batch_row,))

        def holder() -> str | None:
            row = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}[victim["chunk_key"]]
            return row["last_host"] if row["batches"] == 2 else None

        host = deployment.wait_until(holder, budget(120), "the victim chunk to commit two batches", interval=0.5)
        pid = int(host.rsplit(":", 1)[1])
        done_before = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key) if c["state"] == "complete"}
        assert len(done_before) >= 10
        ports, killed_at = tcp_client_ports([pid]), datetime.now(timezone.utc)
        os.kill(pid, signal.SIGKILL)
        deployment.wait_until(lambda: not os.path.exists(f"/proc/{pid}"), budget(5), "the worker to die", 0.1)
        # Its session waits for the held row; anything else it had sent has been finished.
        deployment.wait_sessions_settled(ports, killed_at)
    finally:
        blocker.rollback()
        blocker.close()

    (run,) = deployment.wait_for_runs(
        dag_id, lambda rs: len(rs) == 1 and rs[0]["state"] in ("success", "failed"), timeout=budget(150)
    )
    assert run["state"] == "success"
    final = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
    assert all(c["state"] == "complete" for c in final.values())
    # Completed chunks stayed complete: the same completion, one attempt each.
    for chunk_key, before in done_before.items():
        after = final[chunk_key]
        assert (after["completed_at"], after["attempts"], after["rows_deleted"]) == (
            before["completed_at"],
            1,
            before["rows_deleted"],
        )
    # Only the victim was repeated, and its retry resumed after the two committed batches.
    repeated = {k for k, c in final.items() if c["attempts"] > 1}
    assert repeated == {victim["chunk_key"]}
    v = final[victim["chunk_key"]]
    assert (v["attempts"], v["completed_try_number"], v["rows_deleted"]) == (2, 2, ROWS_PER_CHUNK)
    assert v["batches"] in (5, 6)  # 2 before the kill + 3 (and at most one empty) after; none twice
    assert ledger.get_run(target, key)["state"] == "complete"
    assert sum(c["rows_deleted"] for c in final.values()) == ELIGIBLE
    # The table equals that of an undisturbed run.
    assert one(target, KEEP_SQL) == expected_keep
    # In Airflow: the victim's mapped task instance (map index = its place in the plan) took two tries.
    ti = deployment.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{dag_id}.purge_chunk/{victim['seq']}"
    )
    assert (ti["try_number"], ti["state"]) == (2, "success")
    label = f"tenant {victim['tenants'][0]} · ids [{victim['lo']}, {victim['hi']}) · {ROWS_PER_CHUNK:,} deleted"
    assert ti["rendered_map_index"].startswith(label), ti["rendered_map_index"]  # + "(N on this try)"

    # Redelivery: a completed chunk's task instance cleared in the UI (here through the same REST call)
    # and run again: one completion, zero rows.
    redelivered = next(c for c in final.values() if c["chunk_key"] != victim["chunk_key"])
    rows_before = one(target, "SELECT count(*) FROM drill.events")
    deployment.api(
        "POST",
        f"/dags/{dag_id}/clearTaskInstances",
        json={
            "dry_run": False,
            "only_failed": False,
            "dag_run_id": run["dag_run_id"],
            "task_ids": [[f"{dag_id}.purge_chunk", redelivered["seq"]]],
            "include_downstream": True,
        },
    )
    path = f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{dag_id}.purge_chunk/{redelivered['seq']}"
    again = deployment.wait_until(
        lambda: (t := deployment.api("GET", path))["try_number"] == 2 and t["state"] == "success" and t,
        budget(45),
        "the cleared chunk to run again",
    )
    assert again["try_number"] == 2
    deployment.wait_for_runs(dag_id, lambda rs: rs[0]["state"] == "success", timeout=budget(45))
    replayed = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}[redelivered["chunk_key"]]
    assert (replayed["completed_at"], replayed["completed_try_number"], replayed["attempts"]) == (
        redelivered["completed_at"],
        1,
        1,
    )
    assert one(target, "SELECT count(*) FROM drill.events") == rows_before
    xcom = deployment.api(
        "GET",
        f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{dag_id}.purge_chunk/xcomEntries/return_value",
        params={"map_index": redelivered["seq"]},
    )
    assert '"already_complete": true' in str(xcom["value"]).replace("True", "true").replace("'", '"')
