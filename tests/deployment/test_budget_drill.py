"""The database budget across Celery workers: two policies on one target database, their chunk tasks run by
four worker slots (two Celery workers x two), one small budget (``max_workers: 2``, a 500 ms period) for all.

Each batch's DELETE takes a quarter of a second more (a statement trigger sleeps), so that a chunk's batches,
not Airflow's task overhead, fill its time and the four slots contend for the budget's two batch slots. A chunk
of the first policy is held inside its third batch (a row lock taken here): its task holds a batch slot while it
waits, and its worker is SIGKILLed with every process it started. The batch slots are session-level advisory
locks: the killed session ends once the held row is let go, PostgreSQL releases its slot, and the survivor's
tasks take both slots again; the scheduler fails the killed tasks into retries, which resume their chunks.

A thread samples ``pg_locks`` all along: never more than two batch slots held on the database, and two held
again after the killed session is gone (no slot lost). Both runs complete and every eligible row is deleted
once. The controller's latency thresholds are absolute and out of reach (``upper_latency: 10s``) and the WAL
rate is only recorded, so that on a loaded test machine the budget climbs to its two slots and stays there:
the drill tests the slots, not the canary (tests/core/running/test_controller.py does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.ledger.budget import SLOT_CLASS
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DSN, REPO, throwaway_database
from tests.deployment.conftest import day, one
from tests.deployment.harness import TEST_TIMEOUT, Deployment, budget
from tests.deployment.test_celery import CELERY_ENV, QUEUE

pytestmark = [pytest.mark.scheduler, pytest.mark.timeout(TEST_TIMEOUT)]

CHUNKS, BATCH, BATCHES = 8, 500, 12  # per policy; batches of a chunk (a few more with the fresh rows between)
ROWS_PER_CHUNK = BATCH * BATCHES
ELIGIBLE = CHUNKS * ROWS_PER_CHUNK
IDS = ELIGIBLE * 21 // 20  # one id in 21 is fresh (after the cutoff), the others are eligible
BATCH_SLEEP_S = 0.25
SLOTS = 2
BUDGET = {
    "max_workers": SLOTS,
    "period": "500ms",
    "quiet_periods": 3,
    # Out of reach: the budget climbs to SLOTS and stays (see the module's docstring).
    "upper_latency": "10s",
    "lower_latency": "5s",
    # The test server's connections belong to every test running on it: none kept back here.
    "connection_reserve": 0,
    "max_lock_waiters": 10,
    # Recorded, not obeyed: beside the rest of the suite the server's WAL passes its limit.
    "max_wal_rate": False,
}
TABLES = ("a", "b")


def policy_of(table: str) -> dict[str, Any]:
    return {
        "name": f"budget_{table}",
        "conn_id": "retention_target",
        "table": f"budget_drill.{table}",
        "key_column": "id",
        "chunk_by": "key",  # the drill holds a row of the victim's third batch: batches of exact key ranges
        "timestamp_column": "created_at",
        "retention": "1 day",
        "batch_size": BATCH,
        "target_batch_time": 0,  # fixed batches: the held row is in the third one
        "chunk_rows": ROWS_PER_CHUNK,
        "max_active_chunks": 4,  # each policy could fill the four worker slots: the budget is what limits
        "lock_timeout": "60s",
        "retries": 2,
        "retry_delay": "1s",
        "queue": QUEUE,
        "schedule": None,
        "budget": BUDGET,
    }


def table_sql(table: str) -> str:
    return f"""
CREATE TABLE budget_drill.{table} (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, payload text NOT NULL);
INSERT INTO budget_drill.{table}
SELECT g, CASE WHEN g %% 21 = 0 THEN %(cutoff)s::timestamptz + interval '1 hour'
               ELSE %(cutoff)s::timestamptz - make_interval(secs => 1 + g %% 86400) END,
       md5(g::text)
FROM generate_series(1, {IDS}) g;
CREATE INDEX ON budget_drill.{table} (created_at);
CREATE TRIGGER slow_batch AFTER DELETE ON budget_drill.{table} FOR EACH STATEMENT EXECUTE FUNCTION budget_drill.slow();
ANALYZE budget_drill.{table};
"""


SCHEMA_SQL = f"""
DROP SCHEMA IF EXISTS budget_drill CASCADE;
CREATE SCHEMA budget_drill;
CREATE FUNCTION budget_drill.slow() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN PERFORM pg_sleep({BATCH_SLEEP_S}); RETURN NULL; END $$;
"""
# The batch slots held on the database: session-level advisory locks (SLOT_CLASS, slot).
SLOTS_SQL = (
    "SELECT pid, objid::integer FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted"
    " AND classid = %s::bigint::oid AND objsubid = 2"
    " AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
)


def keep_sql(table: str) -> str:
    return f"SELECT count(*), coalesce(sum(hashtextextended(id::text, 0)::numeric), 0) FROM budget_drill.{table}"


class SlotSampler(threading.Thread):
    """Reads the batch slots held every ``interval`` seconds, on a connection of its own, until stopped."""

    def __init__(self, dsn: str, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.dsn, self.interval = dsn, interval
        self.samples: list[tuple[float, frozenset[tuple[int, int]]]] = []
        self.errors = 0
        self.halt = threading.Event()

    def run(self) -> None:
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        try:
            while not self.halt.is_set():
                try:
                    with conn.cursor() as cur:
                        cur.execute(SLOTS_SQL, (SLOT_CLASS,))
                        held = frozenset((int(pid), int(slot)) for pid, slot in cur.fetchall())
                    self.samples.append((time.monotonic(), held))
                except psycopg2.Error:
                    self.errors += 1  # a busy machine: the next sample
                self.halt.wait(self.interval)
        finally:
            conn.close()

    def stop(self) -> None:
        if not self.halt.is_set():
            self.halt.set()
            self.join(30)

    def most(self, since: float = 0.0, until: float = float("inf")) -> int:
        return max((len(h) for t, h in self.samples if since <= t <= until), default=0)


@pytest.fixture(scope="module")
def drill_dsn() -> Iterator[str]:
    """A target database of the drill's own: the batch slots are the whole database's, no other test's."""
    with throwaway_database("retention_budget_drill") as dsn:
        yield dsn


@pytest.fixture(scope="module")
def drill_policies(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RetentionPolicy]]:
    path = tmp_path_factory.mktemp("budget") / "policies.yaml"
    path.write_text(yaml.safe_dump({"policies": [policy_of(t) for t in TABLES]}, sort_keys=False))
    policies = load_policies(path)
    assert [p.budget.max_workers for p in policies] == [SLOTS, SLOTS]
    assert {p.ledger_schema for p in policies} == {"retention"}  # one ledger: one budget state
    return path, policies


@pytest.fixture(scope="module")
def drill_deployment(drill_dsn: str, drill_policies: tuple[Path, list[RetentionPolicy]]) -> Iterator[Deployment]:
    with Deployment(
        server_dsn=DSN,
        target_dsn=drill_dsn,
        dags_folder=REPO / "dags",
        env={"AIRFLOW_RETENTION_POLICIES": str(drill_policies[0]), **CELERY_ENV},
        executor="CeleryExecutor",
        celery_workers=2,
        celery_queues=QUEUE,
        celery_concurrency=2,
        parse_interval=30,
    ) as running:
        yield running


@pytest.fixture
def drill_target(drill_dsn: str) -> Iterator[Any]:
    conn = psycopg2.connect(drill_dsn)
    conn.autocommit = True
    yield conn
    with conn.cursor() as cur:
        cur.execute("DROP SCHEMA IF EXISTS budget_drill CASCADE")
    conn.close()


@pytest.fixture
def sampler(drill_dsn: str) -> Iterator[SlotSampler]:
    sampling = SlotSampler(drill_dsn)
    sampling.start()
    yield sampling
    sampling.stop()


def test_four_workers_share_one_budget_across_two_policies_and_a_killed_worker_loses_no_slot(
    drill_deployment: Deployment,
    drill_target: Any,
    drill_policies: tuple[Path, list[RetentionPolicy]],
    sampler: SlotSampler,
) -> None:
    d, target, policies = drill_deployment, drill_target, drill_policies[1]
    logical = day(0)
    cutoffs = [freeze_cutoff(p, logical) for p in policies]
    assert len(set(cutoffs)) == 1
    cutoff = cutoffs[0]
    with target.cursor() as cur:
        cur.execute(SCHEMA_SQL)
        for table in TABLES:
            cur.execute(table_sql(table), {"cutoff": cutoff})
    expected_keep = {t: one(target, keep_sql(t) + " WHERE created_at >= %s", (cutoff,)) for t in TABLES}
    for t in TABLES:
        assert one(target, f"SELECT count(*) FROM budget_drill.{t} WHERE created_at < %s", (cutoff,))[0] == ELIGIBLE

    dag_ids = [f"retention_{p.name}" for p in policies]
    for dag_id in dag_ids:
        d.wait_for_dag(dag_id)
        d.unpause(dag_id)
    ledger = Ledger("retention")
    keys = [run_key(p, cutoff) for p in policies]
    blocker = psycopg2.connect(target.dsn)
    started = time.monotonic()
    try:
        for dag_id in dag_ids:
            d.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": logical.strftime("%Y-%m-%dT%H:%M:%SZ")})
        plans = [
            d.wait_until(lambda k=k: ledger.version(target) and ledger.chunk_rows(target, k), budget(35), f"plan {k}")
            for k in keys
        ]
        assert [len(p) for p in plans] == [CHUNKS, CHUNKS]
        # The victim: a chunk of the first policy in the middle of its plan, not started yet. Hold a row of its
        # third batch, so that its task commits two batches and then waits inside the third, holding a slot.
        victim = next(c for c in plans[0][CHUNKS // 2 :] if c["state"] == "pending")
        (held_row,) = one(
            target,
            "SELECT id FROM budget_drill.a WHERE id >= %s AND id < %s ORDER BY id OFFSET %s LIMIT 1",
            (victim["lo"], victim["hi"], 2 * BATCH + BATCH // 2),
        )
        with blocker.cursor() as cur:
            cur.execute("SELECT 1 FROM budget_drill.a WHERE id = %s FOR UPDATE", (held_row,))
            cur.execute("SELECT pg_backend_pid()")
            (blocker_pid,) = cur.fetchone()

        def held_victim() -> tuple[str, int] | None:
            row = {c["chunk_key"]: c for c in ledger.chunk_rows(target, keys[0])}[victim["chunk_key"]]
            if row["batches"] != 2:
                return None
            waiting = one(
                target, "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (blocker_pid,)
            )
            return (row["last_host"], waiting[0]) if waiting else None

        host, victim_backend = d.wait_until(
            held_victim, budget(40), "the victim chunk to wait inside its third batch", interval=0.2
        )
        # The budget has climbed to its two slots, and the victim's session holds one of them while it waits.
        d.wait_until(
            lambda: one(target, "SELECT concurrency, paused FROM retention.budget_state") == (SLOTS, False),
            budget(10),
            f"the budget to reach {SLOTS} slots",
        )
        held = dict(_slots(target))
        assert victim_backend in held, f"the victim's session {victim_backend} holds no batch slot: {held}"
        victim_slot = held[victim_backend]
        doomed = d.worker_of(int(host.rsplit(":", 1)[1]))
        assert doomed is not None, f"{host} is in no Celery worker's session"
        killed_at, killed_wall = time.monotonic(), datetime.now(timezone.utc)
        d.kill_worker(doomed)
        d.wait_sessions_settled(d.killed_ports[doomed], killed_wall)
    finally:
        blocker.rollback()  # the killed task's session now finishes its statement, finds its client gone, ends
        blocker.close()

    def victim_gone() -> bool:
        return one(target, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (victim_backend,))[0] == 0

    d.wait_until(victim_gone, budget(10), "the killed victim's session to end", interval=0.1)
    gone_at = time.monotonic()
    runs = [
        d.wait_for_runs(dag_id, lambda rs: len(rs) == 1 and rs[0]["state"] in ("success", "failed"), budget(60))[0]
        for dag_id in dag_ids
    ]
    elapsed = time.monotonic() - started
    sampler.stop()
    assert [r["state"] for r in runs] == ["success", "success"]

    # The slots: never more than the budget's two on the database, the killed session's slot freed with it, and
    # both slots held again by the others afterwards.
    assert sampler.samples and sampler.errors < len(sampler.samples) // 10
    assert sampler.most() == SLOTS, f"at most {sampler.most()} batch slot(s) held at once"
    assert all(victim_backend not in {pid for pid, _ in h} for t, h in sampler.samples if t >= gone_at)
    after = [h for t, h in sampler.samples if t >= gone_at]
    assert max(len(h) for h in after) == SLOTS, "after the kill the budget never had its two slots busy again"
    assert any(slot == victim_slot for h in after for _, slot in h), "the victim's slot was never taken again"

    # Both runs: every chunk complete exactly once, every eligible row deleted, nothing else.
    for policy, key, table in zip(policies, keys, TABLES, strict=True):
        final = {c["chunk_key"]: c for c in ledger.chunk_rows(target, key)}
        assert len(final) == CHUNKS and all(c["state"] == "complete" for c in final.values()), policy.name
        assert sum(c["rows_deleted"] for c in final.values()) == ELIGIBLE
        assert ledger.get_run(target, key)["rows_deleted"] == ELIGIBLE
        assert one(target, keep_sql(table)) == expected_keep[table]
    v = {c["chunk_key"]: c for c in ledger.chunk_rows(target, keys[0])}[victim["chunk_key"]]
    assert v["completed_try_number"] == 2 and v["attempts"] == 2  # the retry resumed the killed chunk
    # One budget for both policies: one state row, observed by tasks of both, and the waits for a slot recorded.
    assert one(target, "SELECT count(*) FROM retention.budget_state")[0] == 1
    observers = {r[0] for r in _rows(target, "SELECT split_part(observer, '@', 1) FROM retention.budget_observations")}
    paused = [c["paused"] for key in keys for c in ledger.chunk_rows(target, key)]
    waited = sum(p.get("slots", 0.0) for p in paused)
    print(
        f"\nBudget drill: 2 policies x {CHUNKS} chunks x {ROWS_PER_CHUNK:,} rows on 4 worker slots, budget"
        f" {SLOTS} slots; run {elapsed:.1f} s, killed {doomed} {killed_at - started:.1f} s in; at most"
        f" {sampler.most()} slot(s) held ({len(sampler.samples)} samples), {SLOTS} again"
        f" {min(t for t, h in sampler.samples if t >= gone_at and len(h) == SLOTS) - gone_at:.1f} s after the killed"
        f" session ended; observers {sorted(observers)}; {waited:.1f} s waited for a slot in all"
    )
    assert observers == {p.name for p in policies}, observers
    assert waited > 0


def _slots(conn: Any) -> list[tuple[Any, ...]]:
    return _rows(conn, SLOTS_SQL, (SLOT_CLASS,))


def _rows(conn: Any, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return list(cur.fetchall())
