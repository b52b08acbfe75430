"""The upgrade drill (docs/deployment.md, "Upgrading"): a run started by the previous release under the real
scheduler, every component stopped mid-run, the new wheel installed in their place, the same DAG run
finished by the new release.

1. Wheels: 0.1.0's built from its commit (``git archive``), the working tree's from a copy of it; a virtual
   environment of the drill's own with this suite's Airflow and 0.1.0 (``tests/deployment/upgrade.py``).
2. The dags folder as 0.1.0 left it: ``airflow-retention init`` of 0.1.0 (its ``retention_dags.py``) with
   the drill's policy, and a DAG file of a user's that imports the core from 0.1.0's module paths.
3. A deployment (scheduler, dag-processor, api-server, triggerer; LocalExecutor) from that environment;
   a run of the policy: 0.1.0 plans five key chunks (ledger version 6) and runs them one at a time.
4. Mid-run: once a chunk is complete, the test holds the last eligible row of every chunk not complete,
   so that the next chunk commits batches, then waits inside its last one. Then every process of the
   deployment is SIGKILLed at once (the chunk task mid-batch): nobody reports, the chunk's task instance
   stays ``running``.
5. The new wheel installed as docs/deployment.md says (``pip install WHEEL "apache-airflow==..."``), and
   the components started again, the api-server first. The restarted scheduler resets the dead chunk task
   as an orphan of the scheduler that died (once that one's heartbeat is 30 s old; it looks at its start,
   then every ``orphaned_tasks_check_interval``: 5 s here, 5 minutes by default); its next try runs under
   0.2.0, migrates the ledger to version 7 and resumes after the committed batches; the chunks 0.1.0
   planned and never started run under 0.2.0; the verify sensor succeeds.

Then: every eligible row deleted, each counted once (per chunk and in all), no other row touched; the
completed chunks untouched; the ledger at version 7 with ``runs.leaves_deferred`` (NULL for this run,
planned before); the run complete in the ledger; the old DAG file parsed by 0.2.0 (DeprecationWarnings,
no import error); 0.1.0's ledger check (its code, from its wheel) refusing the migrated ledger.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

import airflow_retention
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.schema import SCHEMA_VERSION
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DSN, throwaway_database
from tests.deployment.harness import TEST_TIMEOUT, budget, tcp_client_ports
from tests.deployment.upgrade import (
    PREVIOUS,
    PREVIOUS_LEDGER,
    UpgradeDeployment,
    installed_version,
    one,
    prepare,
    previous_release_on_ledger,
    run,
    upgrade_to,
)

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

CURRENT = airflow_retention.__version__  # the working tree's
POLICY: dict[str, Any] = {
    "name": "upgrade_events",
    "conn_id": "retention_target",
    "table": "upgrade.events",
    "key_column": "id",
    "timestamp_column": "created_at",
    "condition": "status <> 'hold'",
    "chunk_by": "key",
    "retention": "1 day",
    "batch_size": 500,
    "target_batch_time": 0,  # fixed batches: a chunk commits three or four before its last row
    "chunk_rows": 2000,
    "max_active_chunks": 1,  # one chunk task at a time: exactly one is in flight at the stop
    "lock_timeout": "120s",  # the held row must not time the victim's batch out before the stop
    "retries": 3,
    "retry_delay": "2s",
    "schedule": None,
}
DAG_ID = "retention_upgrade_events"
OLD_PATHS_DAG_ID = "upgrade_old_paths"
# Ids 1..12,000: one row in 9 fresh (after the cutoff), one in 13 on hold (the condition keeps it); the other
# 9,846 are eligible: five chunks of 2,000 rows, four or five batches each.
ROWS = 12_000
TABLE_SQL = """
CREATE SCHEMA upgrade;
CREATE TABLE upgrade.events (
    id bigint PRIMARY KEY, created_at timestamptz NOT NULL, status text NOT NULL, payload text NOT NULL
);
INSERT INTO upgrade.events
SELECT g,
       CASE WHEN g %% 9 = 0 THEN %(cutoff)s::timestamptz + interval '1 hour'
            ELSE %(cutoff)s::timestamptz - make_interval(secs => 1 + g %% 86400) END,
       CASE WHEN g %% 13 = 0 THEN 'hold' ELSE 'done' END,
       md5(g::text)
FROM generate_series(1, %(rows)s) g;
CREATE INDEX ON upgrade.events (created_at);
ANALYZE upgrade.events;
"""
ELIGIBLE_SQL = "created_at < %(cutoff)s AND status <> 'hold'"
# A DAG file of a user's, written for 0.1.0: the core imported from 0.1.0's module paths. Its description
# says which release parsed it and which imports warned.
OLD_PATHS_DAG = '''"""A DAG file written for airflow-retention 0.1.0: the core from 0.1.0's module paths."""

from __future__ import annotations

import warnings

from airflow.sdk import DAG

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from airflow_retention.core.cutoff import freeze_cutoff
    from airflow_retention.core.engine import run_chunk
    from airflow_retention.core.planner import plan_run
    from airflow_retention.core.policy import RetentionPolicy
    from airflow_retention.core.verify import verify_run

import airflow_retention
from airflow_retention.dag_factory import retention_task_group

MOVED = sorted(str(w.message).split(" moved")[0] for w in caught if issubclass(w.category, DeprecationWarning))
USED = (freeze_cutoff, run_chunk, plan_run, verify_run)
PARSED_BY = f"parsed by airflow-retention {airflow_retention.__version__}"

with DAG(
    dag_id="upgrade_old_paths",
    schedule=None,
    description=f"{PARSED_BY}; deprecated: {', '.join(MOVED) or 'none'}",
):
    retention_task_group(
        RetentionPolicy(
            name="upgrade_old_paths",
            conn_id="retention_target",
            table="upgrade.other",
            key_column="id",
            timestamp_column="created_at",
            retention="1 day",
        )
    )
'''


@pytest.fixture(scope="module")
def timings() -> Iterator[dict[str, float]]:
    """Seconds per step, printed at the end (``pytest -s``)."""
    steps: dict[str, float] = {}
    yield steps
    print("\nupgrade drill, seconds per step: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))


@pytest.fixture(scope="module")
def environment(
    tmp_path_factory: pytest.TempPathFactory, timings: dict[str, float]
) -> Iterator[tuple[Path, Path, Path]]:
    """``(venv holding Airflow and 0.1.0, 0.1.0's wheel, the working tree's wheel)``; removed afterwards
    (about 240 MB)."""
    started = time.monotonic()
    root = tmp_path_factory.mktemp("upgrade")
    built = prepare(root)
    timings["wheels and environment"] = time.monotonic() - started
    yield built
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def dags_folder(environment: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dags folder as a user of 0.1.0 has it: 0.1.0's ``init`` (its DAG file), the drill's policy, and a
    DAG file that imports the core from 0.1.0's module paths."""
    venv = environment[0]
    dags = tmp_path_factory.mktemp("upgrade-dags")
    run(venv / "bin" / "airflow-retention", "init", dags, cwd=dags)
    (dags / "retention_policies.yaml").write_text(yaml.safe_dump({"policies": [POLICY]}, sort_keys=False))
    (dags / "old_paths_dag.py").write_text(OLD_PATHS_DAG)
    return dags


@pytest.fixture(scope="module")
def upgrade_target() -> Iterator[str]:
    with throwaway_database("retention_upgrade") as dsn:
        yield dsn


@pytest.fixture
def upgrade_deployment(
    environment: tuple[Path, Path, Path], dags_folder: Path, upgrade_target: str, timings: dict[str, float]
) -> Iterator[UpgradeDeployment]:
    started = time.monotonic()
    with UpgradeDeployment(
        venv=environment[0],
        server_dsn=DSN,
        target_dsn=upgrade_target,
        dags_folder=dags_folder,
        env={
            # The restarted scheduler resets the task instances a stopped scheduler left running (its heartbeat
            # older than [scheduler] scheduler_health_check_threshold, 30 s) at its start and then every
            # orphaned_tasks_check_interval: 5 minutes by default, 5 s here.
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5",
        },
    ) as running:
        timings["deployment start"] = time.monotonic() - started
        yield running


def provider_version(deployment: UpgradeDeployment) -> str:
    """The package's version as the api-server lists it among the providers."""
    providers = deployment.api("GET", "/providers")["providers"]
    return next(p["version"] for p in providers if p["package_name"] == "airflow-retention")


@pytest.fixture
def target(upgrade_target: str) -> Iterator[Any]:
    """An autocommit connection to the drill's target database."""
    conn = psycopg2.connect(upgrade_target)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture
def blocker(upgrade_target: str) -> Iterator[Any]:
    """A connection that holds rows (in a transaction) to stop a chunk inside a batch."""
    conn = psycopg2.connect(upgrade_target)
    yield conn
    conn.close()


def test_a_run_started_by_0_1_0_finishes_under_0_2_0(
    upgrade_deployment: UpgradeDeployment,
    environment: tuple[Path, Path, Path],
    target: Any,
    blocker: Any,
    timings: dict[str, float],
) -> None:
    deployment = upgrade_deployment
    venv, old_wheel, new_wheel = environment
    assert installed_version(venv) == PREVIOUS
    policy = RetentionPolicy.from_dict(POLICY)
    logical = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)  # today's run
    cutoff = freeze_cutoff(policy, logical)
    with target.cursor() as cur:
        cur.execute(TABLE_SQL, {"cutoff": cutoff, "rows": ROWS})
        cur.execute(f"SELECT id FROM upgrade.events WHERE {ELIGIBLE_SQL}", {"cutoff": cutoff})
        eligible = {row[0] for row in cur.fetchall()}
        cur.execute("SELECT id FROM upgrade.events")
        keep = {row[0] for row in cur.fetchall()} - eligible
    assert len(eligible) > 4 * POLICY["chunk_rows"] and keep

    # -- 0.1.0 in every component: the provider, the DAGs it parses, the run it plans ------------------------
    assert provider_version(deployment) == PREVIOUS
    deployment.wait_for_dag(DAG_ID)
    old_paths = deployment.wait_for_dag(OLD_PATHS_DAG_ID)
    assert old_paths["description"] == f"parsed by airflow-retention {PREVIOUS}; deprecated: none"
    assert deployment.api("GET", "/importErrors")["total_entries"] == 0
    deployment.unpause(DAG_ID)
    started = time.monotonic()
    deployment.api("POST", f"/dags/{DAG_ID}/dagRuns", json={"logical_date": logical.strftime("%Y-%m-%dT%H:%M:%SZ")})
    ledger = Ledger(policy.ledger_schema)
    (key,) = deployment.wait_until(
        lambda: ledger.version(target) and one(target, "SELECT array_agg(run_key) FROM retention.runs")[0],
        budget(30),
        "0.1.0's plan in the ledger",
    )
    assert key == run_key(policy, cutoff)  # 0.2.0 names the run as 0.1.0 did
    assert ledger.version(target) == PREVIOUS_LEDGER
    chunks = ledger.chunk_rows(target, key)
    assert len(chunks) == 5
    planned = {c["chunk_key"]: sum(1 for i in eligible if c["lo"] <= i < c["hi"]) for c in chunks}
    assert sum(planned.values()) == len(eligible)

    # -- mid-run: a chunk complete, then the last eligible row of every chunk not complete held ---------------
    deployment.wait_until(
        lambda: any(c["state"] == "complete" for c in ledger.chunk_rows(target, key)),
        budget(45),
        "0.1.0 to complete a chunk",
        interval=0.2,
    )
    held = set()
    with blocker.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        (blocker_pid,) = cur.fetchone()
        for c in ledger.chunk_rows(target, key):
            if c["state"] != "complete":
                # A chunk deleting that row right now: the lock waits for its commit, then finds no row.
                cur.execute(
                    f"SELECT id FROM upgrade.events WHERE id >= %(lo)s AND id < %(hi)s AND {ELIGIBLE_SQL}"
                    " ORDER BY id DESC LIMIT 1 FOR UPDATE",
                    {"lo": c["lo"], "hi": c["hi"], "cutoff": cutoff},
                )
                if cur.fetchone():
                    held.add(c["chunk_key"])

    def in_flight() -> dict[str, Any] | None:
        """The held chunk whose task committed batches and now waits for the held row."""
        waiting = one(
            target,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND %s = ANY(pg_blocking_pids(pid))",
            (blocker_pid,),
        )[0]
        running = [c for c in ledger.chunk_rows(target, key) if c["chunk_key"] in held and c["state"] == "running"]
        return running[0] if waiting and len(running) == 1 and running[0]["batches"] >= 1 else None

    victim = deployment.wait_until(in_flight, budget(45), "a chunk task to wait inside its last batch", 0.2)
    before = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
    complete_before = {k: c for k, c in before.items() if c["state"] == "complete"}
    pending_before = {k for k, c in before.items() if c["state"] == "pending"}
    assert complete_before and pending_before, before
    assert 1 <= victim["batches"] and victim["rows_deleted"] < planned[victim["chunk_key"]]
    timings["0.1.0 run until the stop"] = time.monotonic() - started

    # -- the stop: every process at once, the chunk task mid-batch ----------------------------------------------
    stopped = time.monotonic()
    pid = int(victim["last_host"].rsplit(":", 1)[1])
    ports, killed_at = tcp_client_ports([pid]), one(target, "SELECT now()")[0]
    killed = deployment.kill_all()
    assert pid in killed
    blocker.rollback()  # the dead task's batch now fails: it can never commit
    deployment.wait_sessions_settled(ports, killed_at)
    deployment.wait_until(
        lambda: (
            not one(
                target,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND client_port = ANY(%s)"
                " AND backend_start < %s",
                (sorted(ports), killed_at),
            )[0]
        ),
        budget(5),
        "the dead task's session to end",
    )
    # What the stop left: every committed batch counted in the ledger, no other row gone; the chunk task
    # still "running" in Airflow (nothing reported its end).
    at_stop = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
    gone = len(eligible) + len(keep) - one(target, "SELECT count(*) FROM upgrade.events")[0]
    assert gone == sum(c["rows_deleted"] for c in at_stop.values())
    kept = one(target, f"SELECT count(*) FROM upgrade.events WHERE NOT ({ELIGIBLE_SQL})", {"cutoff": cutoff})[0]
    assert kept == len(keep)
    assert at_stop[victim["chunk_key"]]["state"] == "running"
    assert ledger.version(target) == PREVIOUS_LEDGER
    (ti_state,) = deployment._query(
        deployment.metadata_db,
        "SELECT state FROM task_instance WHERE dag_id = %s AND task_id = %s AND map_index = %s",
        (DAG_ID, f"{DAG_ID}.purge_chunk", victim["seq"]),
    )[0]
    assert ti_state == "running"

    # -- the upgrade: the new wheel into the components' environment, the components started again -----------
    timings["stop"] = time.monotonic() - stopped
    installing = time.monotonic()
    upgrade_to(venv, new_wheel)
    assert installed_version(venv) == CURRENT
    timings["install"] = time.monotonic() - installing
    starting = time.monotonic()
    deployment.start_components(api_server_first=True)
    assert provider_version(deployment) == CURRENT
    timings["start again"] = time.monotonic() - starting
    resumed = time.monotonic()
    (dag_run,) = deployment.wait_for_runs(
        DAG_ID, lambda rs: len(rs) == 1 and rs[0]["state"] in ("success", "failed"), timeout=budget(120)
    )
    timings["0.2.0 finishing the run"] = time.monotonic() - resumed
    assert dag_run["state"] == "success"

    # -- every eligible row once, no other row ------------------------------------------------------------------
    with target.cursor() as cur:
        cur.execute("SELECT id FROM upgrade.events")
        assert {row[0] for row in cur.fetchall()} == keep
    final = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
    assert all(c["state"] == "complete" for c in final.values())
    assert {k: c["rows_deleted"] for k, c in final.items()} == planned
    assert sum(c["rows_deleted"] for c in final.values()) == len(eligible)
    for chunk_key, c in complete_before.items():  # complete before the stop: untouched
        after = final[chunk_key]
        assert (after["completed_at"], after["attempts"], after["batches"]) == (c["completed_at"], 1, c["batches"])
    v = final[victim["chunk_key"]]
    assert v["attempts"] == 2  # 0.1.0's, cut short, and the one of 0.2.0 that resumed it
    assert v["batches"] > at_stop[victim["chunk_key"]]["batches"]  # after its committed batches

    # -- the ledger migrated, by 0.2.0's first task; the chunks 0.1.0 planned and never started ran under 0.2.0
    assert ledger.version(target) == SCHEMA_VERSION == 8
    assert (
        one(
            target,
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_schema = 'retention' AND table_name = 'runs' AND column_name = 'leaves_deferred'",
        )[0]
        == 1
    )
    (migrated_at,) = one(target, "SELECT migrated_at FROM retention.ledger_version")
    for chunk_key in pending_before:
        assert final[chunk_key]["attempts"] == 1 and final[chunk_key]["completed_at"] > migrated_at

    # -- verify truthful: the run complete in the ledger, the sensor's task succeeded on the same numbers ----
    ledger_run = ledger.get_run(target, key)
    assert ledger_run["state"] == "complete"
    assert ledger_run["chunks_completed"] == ledger_run["chunks_expected"] == len(final)
    assert ledger_run["rows_deleted"] == len(eligible)
    assert ledger_run["leaves_deferred"] is None  # planned by 0.1.0: not known
    base = f"/dags/{DAG_ID}/dagRuns/{dag_run['dag_run_id']}/taskInstances"
    verify = deployment.api("GET", f"{base}/{DAG_ID}.verify")
    assert verify["state"] == "success"
    summary = deployment.api("GET", f"{base}/{DAG_ID}.verify/xcomEntries/return_value")["value"]
    assert (summary["chunks"], summary["rows_deleted"]) == (len(final), len(eligible)), summary
    # The chunk's task instance: the try that completed the chunk is its last. Try 2 when the api-server
    # listens before the scheduler queues it; a try queued before fails without running (connection refused).
    chunk_ti = deployment.api("GET", f"{base}/{DAG_ID}.purge_chunk/{victim['seq']}")
    assert chunk_ti["state"] == "success"
    assert v["completed_try_number"] == chunk_ti["try_number"] >= 2
    tries = deployment.api("GET", f"{base}/{DAG_ID}.purge_chunk/{victim['seq']}/tries")["task_instances"]
    print(f"\nthe chunk task in flight at the stop: tries {[(t['try_number'], t['state']) for t in tries]}")

    # -- the DAG file written for 0.1.0 parses under 0.2.0, with DeprecationWarnings, without an import error ---
    old_paths = deployment.wait_until(
        lambda: (
            (d := deployment.api("GET", f"/dags/{OLD_PATHS_DAG_ID}"))["description"].startswith(
                f"parsed by airflow-retention {CURRENT};"
            )
            and d
        ),
        budget(30),
        "0.2.0's dag-processor to parse the DAG file written for 0.1.0",
    )
    assert old_paths["description"] == (
        f"parsed by airflow-retention {CURRENT}; deprecated: airflow_retention.core.cutoff.freeze_cutoff,"
        " airflow_retention.core.engine.run_chunk, airflow_retention.core.planner.plan_run,"
        " airflow_retention.core.verify.verify_run"
    )
    assert deployment.api("GET", "/importErrors")["total_entries"] == 0

    # -- and a worker left on 0.1.0 refuses the migrated ledger, deleting nothing -------------------------------
    assert previous_release_on_ledger(venv, old_wheel, deployment.target_dsn, policy.ledger_schema) == (
        f"{PREVIOUS} PermanentError ledger schema 'retention' is at version {SCHEMA_VERSION}, newer than this"
        f" airflow-retention ({PREVIOUS_LEDGER}); upgrade the package"
    )
    assert ledger.version(target) == SCHEMA_VERSION
