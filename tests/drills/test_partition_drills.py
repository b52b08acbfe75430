"""Partition chunks under faults, on both drivers: a worker SIGKILLed before, inside and after the
detach, a query holding the partition, and a role without the privileges a detach or a drop needs.

Each drill runs the chunk in a child process that kills itself (a real SIGKILL) at the named step,
then retries it here and checks that the partition is removed once and counted once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import verify_run
from tests.conftest import DSN, connect
from tests.core.helpers import CUTOFF, ledger_chunk, make_policy, rows, scalar, wait_for
from tests.core.partition_helpers import create_monthly, eligible_count, pending_detach, relations_in

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, signal, sys
from datetime import datetime
import psycopg, psycopg2
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.policy.model import RetentionPolicy

args = json.loads(sys.argv[1])
connect = psycopg.connect if args["driver"] == "psycopg" else psycopg2.connect
conn = connect(args["dsn"], application_name=args["app"])
policy = RetentionPolicy.from_dict(args["policy"])

def step(name):
    if name == args["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)

run_chunk(conn, policy, datetime.fromisoformat(args["cutoff"]), ChunkSpec(**args["chunk"]), on_step=step)
print("finished")
"""


def drop_policy(schema: str, **overrides: Any) -> Any:
    data = {"chunk_by": "block", "key_column": None, "condition": None, "expired_partitions": "drop", **overrides}
    return make_policy(schema, **data)


def start_child(driver: str, policy: Any, chunk: Any, kill_at: str, app: str, err: Path) -> subprocess.Popen:
    args = {
        "driver": driver,
        "dsn": DSN,
        "app": app,
        "kill_at": kill_at,
        "policy": policy_to_dict(policy),
        "cutoff": CUTOFF.isoformat(),
        "chunk": {
            "key": chunk.key,
            "lo": chunk.lo,
            "hi": chunk.hi,
            "seq": chunk.seq,
            "rows_planned": chunk.rows_planned,
            "partition": chunk.partition,
            "partition_oid": chunk.partition_oid,
            "action": chunk.action,
        },
    }
    with err.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True
        )


def session_gone(admin: Any, app: str) -> None:
    wait_for(
        lambda: scalar(admin, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(a)s", {"a": app}) == 0,
        30,
        "the killed worker's session to end",
    )


@pytest.mark.parametrize("kill_at", ["before_detach", "after_detach"])
@pytest.mark.parametrize("condition", [None, "status <> 'open'"], ids=["concurrent", "atomic"])
def test_a_worker_killed_around_the_detach_is_finished_once_by_the_retry(
    schema: str, admin: Any, driver: str, tmp_path: Path, kill_at: str, condition: str | None
) -> None:
    table = create_monthly(admin, schema, status="'closed'")
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    policy = drop_policy(schema, condition=condition)
    conn = connect(driver)
    try:
        plan = plan_run(conn, policy, CUTOFF)
        chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
        app = f"drill-{uuid.uuid4().hex[:8]}"
        child = start_child(driver, policy, chunk, kill_at, app, tmp_path / "child.err")
        assert child.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "child.err").read_text()
        session_gone(admin, app)
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        assert row["state"] != "complete" and row["rows_deleted"] == 0
        # Either way the detach commits on its own, claimed by the chunk in the ledger (the plain detach
        # in its own transaction): after it the partition stands alone; before it nothing was claimed
        # (the atomic one rolled back), so a DBA's detach in between would be left alone.
        assert (row["action_started_at"] is not None) == (kill_at == "after_detach")
        tree = rows(admin, f"SELECT relid::regclass::text FROM pg_partition_tree('{table}')")
        attached = (f"{schema}.m01",) in tree
        assert attached == (kill_at == "before_detach")
        assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january
        assert "m01" in relations_in(admin, schema)
        result = run_chunk(conn, policy, plan.cutoff, chunk)
        assert (result.rows_deleted, result.outcome) == (january, "dropped")
        assert "m01" not in relations_in(admin, schema)
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        assert (row["state"], row["outcome"], row["rows_deleted"]) == ("complete", "dropped", january)
        # A redelivery of the completed chunk changes nothing.
        assert run_chunk(conn, policy, plan.cutoff, chunk).already_complete
        for other in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, other)
        assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok
        assert eligible_count(admin, table, condition=condition) == 0
    finally:
        conn.close()


class Reader:
    """A transaction that has read a partition and holds its ACCESS SHARE lock until released."""

    def __init__(self, relation: str) -> None:
        self.conn = connect("psycopg2")
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {relation}")

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


@pytest.fixture
def reader(schema: str) -> Iterator[list[Reader]]:
    held: list[Reader] = []
    yield held
    for r in held:
        if not r.conn.closed:
            r.release()


def test_a_worker_killed_inside_detach_concurrently_leaves_it_pending_and_the_retry_finalizes(
    schema: str, admin: Any, driver: str, tmp_path: Path, reader: list[Reader]
) -> None:
    create_monthly(admin, schema)
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    policy = drop_policy(schema, lock_timeout="60s")
    conn = connect(driver)
    try:
        plan = plan_run(conn, policy, CUTOFF)
        chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
        # The detach's second transaction waits for this reader's lock on the partition.
        reader.append(Reader(f'"{schema}".m01'))
        app = f"drill-{uuid.uuid4().hex[:8]}"
        child = start_child(driver, policy, chunk, "never", app, tmp_path / "child.err")
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(a)s AND wait_event_type = 'Lock'"
            " AND query ILIKE '%%DETACH PARTITION%%CONCURRENTLY%%'"
        )
        wait_for(lambda: scalar(admin, waiting, {"a": app}) == 1, 30, "the detach to wait inside its second phase")
        assert pending_detach(admin, schema) == ["m01"]
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        # client_connection_check_interval: the backend notices its client is gone and gives up.
        session_gone(admin, app)
        assert pending_detach(admin, schema) == ["m01"]
        reader.pop().release()
        result = run_chunk(conn, policy, plan.cutoff, chunk)
        assert (result.rows_deleted, result.outcome) == (january, "dropped")
        assert pending_detach(admin, schema) == [] and "m01" not in relations_in(admin, schema)
    finally:
        conn.close()


def test_a_query_holding_the_partition_makes_the_detach_retry_later_and_nothing_is_lost(
    schema: str, admin: Any, driver: str, reader: list[Reader]
) -> None:
    table = create_monthly(admin, schema)
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    total = scalar(admin, f"SELECT count(*) FROM {table}")
    policy = drop_policy(schema, lock_timeout="500ms")
    conn = connect(driver)
    try:
        plan = plan_run(conn, policy, CUTOFF)
        chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
        reader.append(Reader(f'"{schema}".m01'))
        with pytest.raises(RetryableError, match="lock timeout"):
            run_chunk(conn, policy, plan.cutoff, chunk)
        # Left pending detach by the timed-out second phase, with every row still there.
        assert pending_detach(admin, schema) == ["m01"]
        assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        assert row["state"] != "complete" and "lock timeout" in row["last_error"]
        # Seen left pending by its own failed detach: the chunk claims it (a FINALIZE by a DBA is ours too).
        assert row["action_started_at"] is not None
        reader.pop().release()
        assert run_chunk(conn, policy, plan.cutoff, chunk).rows_deleted == january
        assert total - january == scalar(admin, f"SELECT count(*) FROM {table}")
    finally:
        conn.close()


def test_a_plain_detach_waits_at_most_lock_timeout_behind_a_query_on_the_table(
    schema: str, admin: Any, driver: str, reader: list[Reader]
) -> None:
    create_monthly(admin, schema, default=True)
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    policy = drop_policy(schema, lock_timeout="500ms")
    conn = connect(driver)
    try:
        plan = plan_run(conn, policy, CUTOFF)
        chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
        reader.append(Reader(f'"{schema}".events'))
        done: list[Any] = []
        worker = threading.Thread(target=lambda: done.append(_attempt(conn, policy, plan.cutoff, chunk)))
        worker.start()
        worker.join(30)
        assert isinstance(done[0], RetryableError)
        assert "m01" in relations_in(admin, schema) and pending_detach(admin, schema) == []
        reader.pop().release()
        assert run_chunk(conn, policy, plan.cutoff, chunk).rows_deleted == january
    finally:
        conn.close()


def _attempt(conn: Any, policy: Any, cutoff: Any, chunk: Any) -> Any:
    try:
        return run_chunk(conn, policy, cutoff, chunk)
    except RetryableError as exc:
        return exc


def test_missing_privileges_fail_at_planning_naming_them_and_nothing_is_removed(
    schema: str, admin: Any, driver: str, purger: str
) -> None:
    table = create_monthly(admin, schema)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    rows(admin, f'CREATE SCHEMA "{schema}_ledger" AUTHORIZATION "{purger}"')
    rows(admin, f'GRANT USAGE ON SCHEMA "{schema}" TO "{purger}"')
    rows(admin, f'GRANT SELECT, DELETE ON {table} TO "{purger}"')
    dsn = make_dsn(DSN, user=purger, password=None)
    conn = connect(driver, dsn)
    try:
        # Rows of a leaf are deleted on the leaf itself: its own grants count, not the parent's.
        with pytest.raises(
            PermanentError, match=rf"insufficient privilege: role {purger} lacks SELECT and DELETE on {schema}\.m0"
        ):
            plan_run(conn, drop_policy(schema, expired_partitions="delete"), CUTOFF)
        for month in range(1, 8):
            rows(admin, f'GRANT SELECT, DELETE ON "{schema}".m{month:02d} TO "{purger}"')
        # Dropping a partition takes owning it and its parent.
        with pytest.raises(PermanentError, match=rf"lacks ownership on {schema}\.m01"):
            plan_run(conn, drop_policy(schema), CUTOFF)
        assert scalar(admin, f"SELECT count(*) FROM {table}") == before
        assert len(relations_in(admin, schema)) == 8
        # With the documented grants the row-by-row purge runs as this role.
        policy = drop_policy(schema, expired_partitions="delete", name="as_purger")
        plan = plan_run(conn, policy, CUTOFF)
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
        assert eligible_count(admin, table) == 0
    finally:
        conn.close()


def test_a_worker_killed_while_its_detach_waits_never_drops_a_partition_a_dba_detached_since(
    schema: str, admin: Any, driver: str, tmp_path: Path
) -> None:
    table = create_monthly(admin, schema)
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    policy = drop_policy(schema, lock_timeout="60s")
    conn = connect(driver)
    holder = connect("psycopg2")
    try:
        plan = plan_run(conn, policy, CUTOFF)
        chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
        with holder.cursor() as cur:
            cur.execute(f"LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE")
        app = f"drill-{uuid.uuid4().hex[:8]}"
        child = start_child(driver, policy, chunk, "never", app, tmp_path / "child.err")
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(a)s AND wait_event_type = 'Lock'"
            " AND query ILIKE '%%DETACH PARTITION%%CONCURRENTLY%%'"
        )
        wait_for(lambda: scalar(admin, waiting, {"a": app}) == 1, 30, "the detach to wait for the parent")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        session_gone(admin, app)
        holder.rollback()
        rows(admin, f'ALTER TABLE {table} DETACH PARTITION "{schema}".m01')  # a DBA keeps it
        result = run_chunk(conn, policy, plan.cutoff, chunk)
        assert (result.outcome, result.rows_deleted) == ("partition_gone", 0)
        assert scalar(admin, f'SELECT count(*) FROM "{schema}".m01') == january
        # The killed detach never began: nothing claimed the partition for the chunk.
        assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["action_started_at"] is None
    finally:
        holder.close()
        conn.close()


DEADLOCK = "40P01"


class Writers:
    """Application sessions writing through the parent while the purge runs: an UPDATE by id, which no
    bound prunes (it locks the parent, then every partition), and an INSERT of a new row of July. Each
    records how long each statement took and the SQLSTATE of each error."""

    def __init__(self, table: str, ids: list[int], sessions: int = 3) -> None:
        self.table = table
        self.ids = ids
        self.stop = threading.Event()
        self.errors: list[tuple[str | None, str]] = []
        self.waits: list[float] = []
        self.inserted: list[int] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(sessions)]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self, n: int) -> None:
        import random
        import time

        conn = connect("psycopg2")
        conn.autocommit = True
        step = 0
        try:
            with conn.cursor() as cur:
                while not self.stop.is_set():
                    step += 1
                    new_id = 10_000_000 + n * 1_000_000 + step
                    started = time.monotonic()
                    try:
                        cur.execute(
                            f"UPDATE {self.table} SET payload = md5(random()::text) WHERE id = %(id)s",
                            {"id": random.choice(self.ids)},
                        )
                        cur.execute(
                            f"INSERT INTO {self.table} (id, tenant_id, created_at, status, payload)"
                            " VALUES (%(id)s, 1, timestamptz '2024-07-15', 'open', 'new')",
                            {"id": new_id},
                        )
                        with self.lock:
                            self.inserted.append(new_id)
                    except Exception as exc:  # noqa: BLE001 - every error is recorded and asserted on
                        with self.lock:
                            self.errors.append((getattr(exc, "pgcode", None), str(exc)))
                    with self.lock:
                        self.waits.append(time.monotonic() - started)
        finally:
            conn.close()


@pytest.mark.parametrize("shape", ["condition", "default-partition"])
def test_the_atomic_detach_never_deadlocks_writers_through_the_parent(
    schema: str, admin: Any, driver: str, shape: str
) -> None:
    table = create_monthly(admin, schema, status="'closed'", default=shape == "default-partition")
    expired = {m: scalar(admin, f'SELECT count(*) FROM "{schema}".{m}') for m in ("m01", "m02", "m03", "m04", "m05")}
    july = [r[0] for r in rows(admin, f'SELECT id FROM "{schema}".m07')]
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    lock_timeout_s = 1.0
    policy = drop_policy(
        schema, condition="status <> 'open'" if shape == "condition" else None, lock_timeout=f"{lock_timeout_s}s"
    )
    conn = connect(driver)
    hook_conn = connect("psycopg2")
    hook_conn.autocommit = True
    hook_errors: list[tuple[str | None, str]] = []
    chunk_errors: list[tuple[str | None, str]] = []

    def update_one() -> None:
        try:
            with hook_conn.cursor() as cur:
                cur.execute(f"UPDATE {table} SET payload = 'hook' WHERE id = %(id)s", {"id": july[0]})
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on
            hook_errors.append((getattr(exc, "pgcode", None), str(exc)))

    hook_thread: list[threading.Thread] = []

    def writer_in_the_middle(step: str) -> None:
        # Just before the DETACH: an application UPDATE through the parent, held until it waits for a
        # lock the chunk holds. Locks taken partition first then parent deadlock here.
        if step != "before_detach" or hook_thread:
            return
        pid = hook_conn.get_backend_pid()
        hook_thread.append(threading.Thread(target=update_one))
        hook_thread[0].start()
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE pid = %(p)s AND wait_event_type = 'Lock'"
        wait_for(lambda: scalar(admin, waiting, {"p": pid}) == 1, 10, "the application's UPDATE to wait")

    try:
        plan = plan_run(conn, policy, CUTOFF)
        actions = [c for c in plan.chunks if c.action]
        assert sorted(str(c.partition) for c in actions) == [f"{schema}.{m}" for m in expired]
        outcomes = {}
        with Writers(table, july[1:]) as writers:  # july[0] is the UPDATE in the middle's
            wait_for(lambda: len(writers.inserted) >= 20, 30, "the writers to get going")
            during = len(writers.inserted)
            for chunk in actions:
                result = None
                for _ in range(20):  # a lock timeout is a retry away; a deadlock is a failure
                    try:
                        result = run_chunk(conn, policy, plan.cutoff, chunk, on_step=writer_in_the_middle)
                        break
                    except RetryableError as exc:
                        chunk_errors.append((exc.sqlstate, str(exc)))
                        if exc.sqlstate == DEADLOCK:
                            break
                found = (result.outcome, result.rows_deleted) if result is not None else None
                outcomes[str(chunk.partition).split(".")[1]] = found
            assert len(writers.inserted) > during  # they went on writing while the partitions went
        for t in hook_thread:
            t.join(30)
        assert [e for e in writers.errors + hook_errors + chunk_errors if e[0] == DEADLOCK] == []
        assert writers.errors == [] and hook_errors == [] and hook_thread
        assert all(e[0] == "55P03" for e in chunk_errors), chunk_errors  # only lock timeouts, retried
        # A writer waits at most for the chunk's own bounded wait and its short hold of the parent.
        assert writers.waits and max(writers.waits) < lock_timeout_s + 4.0, max(writers.waits)
        assert outcomes == {m: ("dropped", n) for m, n in expired.items()}
        assert relations_in(admin, schema).isdisjoint(expired)
        after = scalar(admin, f"SELECT count(*) FROM {table}")
        assert after == before - sum(expired.values()) + len(writers.inserted)
        assert scalar(admin, f"SELECT count(*) FROM {table} WHERE payload = 'hook'") == 1
    finally:
        hook_conn.close()
        conn.close()
