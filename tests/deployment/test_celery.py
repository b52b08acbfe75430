"""The purge under CeleryExecutor: Redis as the broker, the metadata database as the result backend, two
Celery workers on the policy's queue (``queue: retention``), each with two slots.

32 chunks x 5,000 rows spread over both workers. A chunk in the middle of the plan is held inside its third
batch (a row lock taken here), and its worker is SIGKILLed with every process it started: nothing reports the
loss. The scheduler finds the worker's task instances without a heartbeat after
``[scheduler] task_instance_heartbeat_timeout``, fails them into a retry, and the surviving worker runs the
retries. The held chunk resumes from its last committed batch; the table ends as an undisturbed run leaves it.

Who did what: both workers run on this machine, so the ledger's ``completed_host`` ("hostname:pid", with
``socket.gethostname()``) tells them apart only by the task process's pid. The harness gives each worker a
hostname of its own through ``[core] hostname_callable``; the test joins each chunk's ``completed_host`` pid to
the pid of the task instance try that completed it (``completed_map_index``, ``completed_try_number``), whose
``hostname`` names the worker.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DSN, REPO
from tests.deployment.conftest import day, one
from tests.deployment.harness import TEST_TIMEOUT, Deployment, budget

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

CHUNKS, ROWS_PER_CHUNK, BATCH = 32, 5_000, 1_000
ELIGIBLE = CHUNKS * ROWS_PER_CHUNK
IDS = ELIGIBLE * 21 // 20  # one id in 21 is fresh (after the cutoff), the others are eligible
QUEUE = "retention"
CELERY_POLICY = {
    "name": "celery_events",
    "conn_id": "retention_target",
    "table": "celery_drill.events",
    "key_column": "id",
    "chunk_by": "key",  # the drill holds a row of the victim's third batch: batches of exact key ranges
    "timestamp_column": "created_at",
    "retention": "1 day",
    "batch_size": BATCH,
    "target_batch_time": 0,  # fixed batches: the held row is in the third one
    "chunk_rows": ROWS_PER_CHUNK,
    "max_active_chunks": 4,  # = 2 workers x 2 slots
    "lock_timeout": "30s",
    "retries": 2,
    "retry_delay": "1s",
    "queue": QUEUE,
    "schedule": None,
}
# Fast failure detection, so the test takes about a minute and a half; see docs/scaling.md for production values.
CELERY_ENV = {
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "15",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
    "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
    # A task delivered to the killed worker but not started yet stays queued: hand it back after 45 s.
    "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "45",
    "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "5",
    # Longer than any task here: Redis never redelivers a message whose task is still running.
    "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "3600",
}
TABLE_SQL = f"""
DROP SCHEMA IF EXISTS celery_drill CASCADE;
CREATE SCHEMA celery_drill;
CREATE TABLE celery_drill.events (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, payload text NOT NULL);
INSERT INTO celery_drill.events
SELECT g, CASE WHEN g %% 21 = 0 THEN %(cutoff)s::timestamptz + interval '1 hour'
               ELSE %(cutoff)s::timestamptz - make_interval(secs => 1 + g %% 86400) END,
       md5(g::text)
FROM generate_series(1, {IDS}) g;
CREATE INDEX ON celery_drill.events (created_at);
ANALYZE celery_drill.events;
"""
KEEP_SQL = "SELECT count(*), coalesce(sum(hashtextextended(id::text, 0)::numeric), 0) FROM celery_drill.events"


def pss_mib(pid: int) -> float:
    """Proportional set size: shared pages (the fork's copy-on-write ones) counted once across processes."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:"))) / 1024


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


@pytest.fixture(scope="module")
def celery_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RetentionPolicy]:
    path = tmp_path_factory.mktemp("celery") / "policies.yaml"
    path.write_text(yaml.safe_dump({"policies": [CELERY_POLICY]}, sort_keys=False))
    (policy,) = load_policies(path)
    assert policy.queue == QUEUE
    return path, policy


@pytest.fixture(scope="module")
def celery_deployment(target_dsn: str, celery_policy: tuple[Path, RetentionPolicy]) -> Iterator[Deployment]:
    with Deployment(
        server_dsn=DSN,
        target_dsn=target_dsn,
        dags_folder=REPO / "dags",
        env={"AIRFLOW_RETENTION_POLICIES": str(celery_policy[0]), **CELERY_ENV},
        executor="CeleryExecutor",
        celery_workers=2,
        celery_queues=QUEUE,
        celery_concurrency=2,
        parse_interval=30,  # the policies file never changes: its DAG file is parsed once, at the start
    ) as running:
        yield running


@pytest.fixture
def celery_target(target_dsn: str) -> Iterator[Any]:
    conn = psycopg2.connect(target_dsn)
    conn.autocommit = True
    yield conn
    with conn.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS celery_drill CASCADE")
    conn.close()


def test_two_celery_workers_share_the_chunks_and_the_survivor_finishes_a_killed_workers_chunk(
    celery_deployment: Deployment, celery_target: Any, celery_policy: tuple[Path, RetentionPolicy]
) -> None:
    d, target, policy = celery_deployment, celery_target, celery_policy[1]
    logical = day(0)
    cutoff = freeze_cutoff(policy, logical)
    with target.cursor() as cur:
        cur.execute(TABLE_SQL, {"cutoff": cutoff})
    expected_keep = one(target, KEEP_SQL + " WHERE created_at >= %s", (cutoff,))
    assert one(target, "SELECT count(*) FROM celery_drill.events WHERE created_at < %s", (cutoff,))[0] == ELIGIBLE

    dag_id = f"retention_{policy.name}"
    chunk_task = f"{dag_id}.purge_chunk"
    d.wait_for_dag(dag_id)
    d.unpause(dag_id)
    ledger = Ledger(policy.ledger_schema)
    key = run_key(policy, cutoff)
    blocker = psycopg2.connect(target.dsn)
    started = time.monotonic()
    try:
        run = d.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": logical.strftime("%Y-%m-%dT%H:%M:%SZ")})
        chunks = d.wait_until(lambda: ledger.version(target) and ledger.chunk_rows(target, key), budget(30), "the plan")
        assert len(chunks) == CHUNKS
        # The victim: the chunk in the middle of the plan, not started yet. Hold a row of its third batch, so
        # that its worker commits two batches and then waits inside the third one when it is killed.
        victim = next(c for c in chunks[CHUNKS // 2 :] if c["state"] == "pending")
        (third_batch_row,) = one(
            target,
            "SELECT id FROM celery_drill.events WHERE id >= %s AND id < %s AND created_at < %s"
            " ORDER BY id OFFSET %s LIMIT 1",
            (victim["lo"], victim["hi"], cutoff, 2 * BATCH + BATCH // 2),
        )
        with blocker.cursor() as cur:
            cur.execute("SELECT 1 FROM celery_drill.events WHERE id = %s FOR UPDATE", (third_batch_row,))

        def holder() -> str | None:
            row = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}[victim["chunk_key"]]
            return row["last_host"] if row["batches"] == 2 else None

        host = d.wait_until(holder, budget(40), "the victim chunk to commit two batches", interval=0.2)
        victim_pid = int(host.rsplit(":", 1)[1])
        doomed = d.worker_of(victim_pid)  # the task process is alive, blocked in the held batch
        assert doomed is not None, f"pid {victim_pid} is in no Celery worker's session"
        (survivor,) = set(d.workers) - {doomed}
        task_pss = pss_mib(victim_pid) + pss_mib(parent_pid(victim_pid))  # the task process and its supervisor
        killed_at, killed_wall = time.monotonic(), datetime.now(timezone.utc)
        d.kill_worker(doomed)
        # Read after the kill, and after the server has finished what the killed processes had sent: the
        # doomed worker's other slot may complete a chunk up to the moment it dies (its commit lands after).
        d.wait_sessions_settled(d.killed_ports[doomed], killed_wall)
        done_before = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key) if c["state"] == "complete"}
        assert len(done_before) >= 8
    finally:
        blocker.rollback()  # the killed task's server session now fails its batch and rolls it back
        blocker.close()

    (run,) = d.wait_for_runs(dag_id, lambda rs: len(rs) == 1 and rs[0]["state"] in ("success", "failed"), budget(120))
    elapsed, after_kill = time.monotonic() - started, time.monotonic() - killed_at
    assert run["state"] == "success"

    # The ledger: every chunk complete exactly once, the rows of an undisturbed run deleted, nothing else.
    final = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
    assert len(final) == CHUNKS and all(c["state"] == "complete" for c in final.values())
    assert all(c["rows_deleted"] == ROWS_PER_CHUNK for c in final.values())
    assert ledger.get_run(target, key)["state"] == "complete"
    assert ledger.get_run(target, key)["rows_deleted"] == ELIGIBLE
    assert one(target, KEEP_SQL) == expected_keep
    # Chunks completed before the kill stayed as they were: one attempt, the same completion.
    for chunk_key, before in done_before.items():
        after = final[chunk_key]
        assert (after["completed_at"], after["attempts"], after["completed_try_number"]) == (
            before["completed_at"],
            1,
            1,
        )
    # The victim resumed after its two committed batches, on its second try.
    v = final[victim["chunk_key"]]
    assert (v["attempts"], v["completed_try_number"]) == (2, 2)
    assert v["batches"] in (5, 6)  # 2 before the kill + 3 (and at most one empty) after; none twice

    # Who completed what: the task instance try named by the ledger ran in the worker and task process the
    # ledger names.
    run_path = f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}/taskInstances/{chunk_task}"
    tries: dict[str, dict[str, Any]] = {}
    for chunk_key, c in final.items():
        ti = d.api("GET", f"{run_path}/{c['completed_map_index']}/tries/{c['completed_try_number']}")
        hostname, pid = c["completed_host"].rsplit(":", 1)
        # The ledger names the worker by Airflow's hostname for the task instance ([core] hostname_callable).
        assert hostname == ti["hostname"] and hostname in d.workers
        assert ti["pid"] == int(pid)
        tries[chunk_key] = ti
    by_worker = {name: {k for k, ti in tries.items() if ti["hostname"] == name} for name in d.workers}
    assert by_worker[doomed] and by_worker[survivor], by_worker  # the chunks spread over both workers
    assert by_worker[doomed] <= set(done_before)  # nothing completed by the dead worker after its death
    assert victim["chunk_key"] in by_worker[survivor]
    first_try = d.api("GET", f"{run_path}/{victim['seq']}/tries/1")
    assert (first_try["hostname"], first_try["pid"], first_try["state"]) == (doomed, victim_pid, "failed")
    # Only chunks whose first try ran on the killed worker were tried again.
    retried = {k for k, c in final.items() if c["completed_try_number"] > 1 or c["attempts"] > 1}
    for chunk_key in retried:
        assert d.api("GET", f"{run_path}/{final[chunk_key]['seq']}/tries/1")["hostname"] == doomed
    assert victim["chunk_key"] in retried

    # Numbers for docs/scaling.md (shown with -s): task overhead under Celery, rows/s of a chunk.
    clean = [k for k, c in final.items() if c["attempts"] == 1 and c["completed_try_number"] == 1]
    in_task = [
        (ts(tries[k]["end_date"]) - ts(tries[k]["start_date"])).total_seconds()
        - (final[k]["completed_at"] - final[k]["first_started_at"]).total_seconds()
        for k in clean
    ]
    queued = [(ts(tries[k]["start_date"]) - ts(tries[k]["queued_when"])).total_seconds() for k in clean]
    purge = [(final[k]["completed_at"] - final[k]["first_started_at"]).total_seconds() for k in clean]
    # Slot time per chunk while all four slots were free for ordinary chunks (before the victim started).
    window_start = min(ts(ti["start_date"]) for ti in tries.values())
    window_end = v["first_started_at"]
    early = sum(1 for c in final.values() if c["completed_at"] <= window_end)
    slot_seconds = 4 * (window_end - window_start).total_seconds() / max(early, 1)
    print(
        f"\nCelery drill: {CHUNKS} chunks x {ROWS_PER_CHUNK:,} rows, {len(by_worker[doomed])} completed by"
        f" {doomed} (killed), {len(by_worker[survivor])} by {survivor}; retried {sorted(retried)};"
        f" run {elapsed:.1f} s, {after_kill:.1f} s after the kill.\n"
        f"per chunk task (median of {len(clean)}): queued->start {statistics.median(queued):.2f} s,"
        f" task overhead outside the batches {statistics.median(in_task):.2f} s,"
        f" batches {statistics.median(purge):.2f} s = {ROWS_PER_CHUNK / statistics.median(purge):,.0f} rows/s;"
        f" {early} chunks in {(window_end - window_start).total_seconds():.1f} s on 4 slots ="
        f" {slot_seconds:.2f} slot-seconds per chunk; PSS of a chunk task (task process + supervisor)"
        f" {task_pss:.0f} MiB"
    )
