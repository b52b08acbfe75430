"""The ledger tables: creation, migration guard, concurrency of ensure(), idempotent registration."""

from __future__ import annotations

import dataclasses
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec, RunRecord
from airflow_retention.core.ledger.schema import _MIGRATIONS, SCHEMA_VERSION
from tests.conftest import connect
from tests.core.helpers import CUTOFF, ledger_chunks, ledger_run, rows, scalar, start_and_join

LEDGER_TABLES = [
    "budget_canary", "budget_observations", "budget_state", "chunks", "dead_letters", "ledger_version",
    "plan_failures", "runs", "tenant_counts", "tenant_cutoffs",
]  # fmt: skip


def _tables(admin: Any, schema: str) -> list[str]:
    return [
        r[0]
        for r in rows(
            admin, "SELECT tablename FROM pg_tables WHERE schemaname = %(s)s ORDER BY tablename", {"s": schema}
        )
    ]


def test_ensure_creates_and_is_idempotent(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    assert ledger.version(conn) is None
    assert ledger.ensure(conn) == SCHEMA_VERSION
    assert _tables(admin, f"{schema}_ledger") == LEDGER_TABLES
    migrated = scalar(admin, f'SELECT migrated_at FROM "{schema}_ledger".ledger_version')
    assert ledger.ensure(conn) == SCHEMA_VERSION
    assert ledger.version(conn) == SCHEMA_VERSION
    # An up-to-date ledger is only read: no second migration.
    assert rows(admin, f'SELECT version, migrated_at FROM "{schema}_ledger".ledger_version') == [
        (SCHEMA_VERSION, migrated)
    ]


def test_concurrent_ensure_on_a_fresh_schema(schema: str, conn: Any, admin: Any, driver: str) -> None:
    ledger_schema = f"{schema}_ledger"
    callers = 8
    barrier = threading.Barrier(callers)
    results: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        c = connect(driver)
        try:
            barrier.wait(timeout=30)
            version = Ledger(ledger_schema).ensure(c)
            with lock:
                results.append(version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work) for _ in range(callers)]
    start_and_join(threads, 60)
    assert errors == []
    assert results == [SCHEMA_VERSION] * callers
    assert Ledger(ledger_schema).version(conn) == SCHEMA_VERSION
    assert scalar(admin, f'SELECT count(*) FROM "{ledger_schema}".ledger_version') == 1
    assert _tables(admin, ledger_schema) == LEDGER_TABLES


def test_newer_ledger_is_refused(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    rows(admin, f'UPDATE "{schema}_ledger".ledger_version SET version = %(v)s', {"v": SCHEMA_VERSION + 1})
    with pytest.raises(PermanentError, match="newer than this airflow-retention"):
        ledger.ensure(conn)


def _record(key: str, chunks: int) -> RunRecord:
    """A run record; its policy is derived from the key, as the ledger allows one run per policy and cutoff."""
    return RunRecord(
        run_key=key,
        policy=key.replace("@", "_"),
        target_table="public.t",
        cutoff=CUTOFF,
        dry_run=False,
        chunk_rows=10,
        batch_size=5,
        chunks_expected=chunks,
        rows_planned=chunks * 10,
        planned_by="test",
    )


def test_register_run_and_chunks_are_idempotent(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    chunk = ChunkSpec(key="t=a:1-11", lo=1, hi=11, tenants=("a",), seq=0, rows_planned=10)
    created = []
    for _ in range(2):
        with dbapi.transaction(conn) as cur:
            created.append(ledger.register_run(cur, _record("p@x", 1)))
            ledger.insert_chunk(cur, "p@x", chunk)
    assert created == [True, False]
    assert ledger.stored_plan(conn, "p@x") == [chunk]
    stored = ledger_chunks(admin, f"{schema}_ledger", "p@x")
    assert len(stored) == 1
    assert (stored[0]["state"], stored[0]["next_key"], stored[0]["rows_deleted"]) == ("pending", 1, 0)


def test_empty_run_is_complete_at_registration(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    with dbapi.transaction(conn) as cur:
        ledger.register_run(cur, _record("p@empty", 0))
        ledger.register_run(cur, _record("p@lone", 0), complete_if_empty=False)
    empty = ledger_run(admin, f"{schema}_ledger", "p@empty")
    assert empty is not None
    assert (empty["state"], empty["rows_deleted"], empty["chunks_completed"]) == ("complete", 0, 0)
    assert empty["completed_at"] is not None
    lone = ledger_run(admin, f"{schema}_ledger", "p@lone")
    assert lone is not None
    assert (lone["state"], lone["completed_at"]) == ("planned", None)


def test_complete_run_sums_chunks_and_first_verification_wins(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    with dbapi.transaction(conn) as cur:
        ledger.register_run(cur, _record("p@y", 2))
        ledger.insert_chunks(cur, "p@y", [ChunkSpec("a", 1, 11, seq=0), ChunkSpec("b", 11, 21, seq=1)])
    rows(
        admin,
        f"UPDATE \"{schema}_ledger\".chunks SET state = 'complete', rows_deleted = 7, rows_archived = 2"
        " WHERE chunk_key = 'a'",
    )
    rows(admin, f"UPDATE \"{schema}_ledger\".chunks SET rows_deleted = 3 WHERE chunk_key = 'b'")
    first = ledger.complete_run(conn, "p@y", "verifier-1")
    assert (first["state"], first["chunks_completed"], first["rows_deleted"], first["rows_archived"]) == (
        "complete",
        1,
        10,
        2,
    )
    second = ledger.complete_run(conn, "p@y", "verifier-2")
    assert second["verified_by"] == "verifier-1"
    assert second["completed_at"] == first["completed_at"]


def test_a_version_1_ledger_is_migrated_and_keeps_its_rows(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    s = ledger.s
    # A ledger as version 1 of the package left it, with a run half done.
    rows(admin, f"CREATE SCHEMA {s}")
    rows(admin, _MIGRATIONS[1].format(s=s))
    rows(
        admin,
        f"CREATE TABLE {s}.ledger_version (singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
        " version integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now())",
    )
    rows(admin, f"INSERT INTO {s}.ledger_version (version) VALUES (1)")
    with dbapi.transaction(conn) as cur:
        # The run and chunk rows as version 1 wrote them (today's inserts name columns v1 did not have).
        cur.execute(
            f"INSERT INTO {s}.runs (run_key, policy, target_table, cutoff, state, chunk_rows, batch_size,"
            " chunks_expected, rows_planned, planned_by)"
            " VALUES ('p@v1', 'p_v1', 'public.t', %(c)s, 'planned', 10, 5, 2, 20, 'test')",
            {"c": CUTOFF},
        )
        cur.execute(
            f"INSERT INTO {s}.chunks (run_key, chunk_key, seq, lo, hi, next_key)"
            " VALUES ('p@v1', 'a', 0, 1, 11, 1), ('p@v1', 'b', 1, 11, 21, 11)"
        )
    rows(
        admin,
        f"UPDATE {s}.chunks SET state = 'running', next_key = 6, rows_deleted = 4, batches = 1 WHERE chunk_key = 'a'",
    )
    assert ledger.version(conn) == 1
    old_chunks = ledger_chunks(admin, ledger.schema, "p@v1")
    old_run = ledger_run(admin, ledger.schema, "p@v1")

    assert ledger.ensure(conn) == SCHEMA_VERSION == 8
    assert ledger.version(conn) == 8
    chunks = ledger_chunks(admin, ledger.schema, "p@v1")
    new_columns = {
        "tenant_pos": 0,
        "last_batch_size": None,
        "min_batch_size": None,
        "max_batch_size": None,
        "backoffs": 0,
        "backoff_seconds": 0,
        "partition": None,
        "partition_oid": None,
        "action": None,
        "action_started_at": None,
        "paused": {},
    }
    for before, after in zip(old_chunks, chunks, strict=True):
        assert set(after) - set(before) == set(new_columns)
        assert {k: after[k] for k in before} == before  # every old value kept
        assert {k: after[k] for k in new_columns} == new_columns
    # Step 3 widened the outcome check for partition chunks.
    rows(admin, f"UPDATE {s}.chunks SET outcome = 'dropped', action = 'drop' WHERE chunk_key = 'b'")
    with pytest.raises(Exception, match="chunks_action_check"):
        rows(admin, f"UPDATE {s}.chunks SET action = 'truncate' WHERE chunk_key = 'b'")
    run = ledger_run(admin, ledger.schema, "p@v1")
    assert run is not None and old_run is not None
    assert {k: run[k] for k in old_run} == old_run
    assert {k: run[k] for k in set(run) - set(old_run)} == {
        "oldest_eligible_at": None,
        "eligible_left": None,
        "cleanup_lag_seconds": None,
        "lag_measured_at": None,
        "vacuumed_at": None,
        "run_date": None,
        "leaves_deferred": None,
    }
    # The migrated ledger works with the new code: progress with a tenant position, and read back.
    with dbapi.transaction(conn) as cur:
        assert ledger.lock_chunk(cur, "p@v1", "a")[:7] == ("running", 6, 1, 11, None, 4, 0)
    assert [c["chunk_key"] for c in ledger.chunk_rows(conn, "p@v1")] == ["a", "b"]
    assert ledger.ensure(conn) == SCHEMA_VERSION  # and it is not migrated twice
    assert scalar(admin, f"SELECT count(*) FROM {s}.ledger_version") == 1


def test_a_failed_plan_is_recorded_counted_and_read_back_and_pruned(schema: str, conn: Any, admin: Any) -> None:
    """plan_failures (version 6): a failed plan's run key, error and attempts; nothing recorded without a
    ledger; pruned with the policy's old runs."""
    ledger = Ledger(f"{schema}_ledger")
    cutoff = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert not ledger.record_plan_failure(conn, "p", "p@x", cutoff, "boom", "dag/run/-1/try 1")  # no ledger yet
    assert ledger.version(conn) is None
    ledger.ensure(conn)
    assert ledger.latest_plan_failure(conn, "p") is None
    assert ledger.record_plan_failure(conn, "p", "p@x", cutoff, "boom", "dag/run/-1/try 1")
    assert ledger.record_plan_failure(conn, "p", "p@x", cutoff, "boom again", "dag/run/-1/try 2")
    assert ledger.record_plan_failure(conn, "other", "other@x", cutoff, "x" * 5000, None)
    failure = ledger.latest_plan_failure(conn, "p")
    assert failure is not None
    assert (failure["run_key"], failure["error"], failure["attempts"]) == ("p@x", "boom again", 2)
    assert failure["failed_by"] == "dag/run/-1/try 2" and failure["failed_at"] >= failure["first_at"]
    other = ledger.latest_plan_failure(conn, "other")
    assert other is not None and len(other["error"]) == 2000
    aged = f"UPDATE \"{schema}_ledger\".plan_failures SET failed_at = now() - interval '40 days'"
    rows(admin, aged + " WHERE policy = 'p'")
    ledger.prune(conn, "p", 35)
    assert ledger.latest_plan_failure(conn, "p") is None and ledger.latest_plan_failure(conn, "other") is not None


def test_a_role_without_grants_on_plan_failures_still_plans_prunes_and_reads(schema: str, admin: Any) -> None:
    """An administrator migrated the ledger to version 6 and granted the purge role only the older tables:
    recording a failed plan, pruning failed plans and reading them give up quietly; nothing else fails."""
    import psycopg2
    from psycopg2.extensions import make_dsn

    ledger = Ledger(f"{schema}_ledger")
    owner = psycopg2.connect(admin.dsn)
    try:
        ledger.ensure(owner)
    finally:
        owner.close()
    role = f"{schema}_purger"
    s = ledger.s
    rows(admin, f'CREATE ROLE "{role}" LOGIN')
    try:
        rows(admin, f'GRANT USAGE ON SCHEMA {s} TO "{role}"')
        rows(admin, f'GRANT SELECT ON {s}.ledger_version TO "{role}"')
        rows(admin, f'GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.runs, {s}.chunks TO "{role}"')
        purger = psycopg2.connect(make_dsn(admin.dsn, user=role))
        try:
            cutoff = datetime(2026, 1, 1, tzinfo=timezone.utc)
            assert not ledger.record_plan_failure(purger, "p", "p@x", cutoff, "boom", None)
            assert ledger.latest_plan_failure(purger, "p") is None
            assert ledger.prune(purger, "p", 35) == 0
            assert ledger.recent_runs(purger, "p", limit=5) == []  # the connection is usable afterwards
        finally:
            purger.close()
    finally:
        rows(admin, f'DROP OWNED BY "{role}"')
        rows(admin, f'DROP ROLE "{role}"')


def test_prune_deletes_only_the_policys_runs_last_touched_long_ago(schema: str, conn: Any, admin: Any) -> None:
    ledger = Ledger(f"{schema}_ledger")
    ledger.ensure(conn)
    s = ledger.s
    ages = {  # run key: (policy, planned days ago, completed days ago)
        "p@old": ("p", 100, None),
        "p@old-done": ("p", 100, 95),
        "p@old-plan-recent-finish": ("p", 100, 10),
        "p@recent": ("p", 10, None),
        "p@edge": ("p", 89, None),
        "q@old": ("q", 100, 100),
    }
    with dbapi.transaction(conn) as cur:
        for key, (policy, _, _) in ages.items():
            ledger.register_run(cur, dataclasses.replace(_record(key, 1), policy=policy))
            ledger.insert_chunk(cur, key, ChunkSpec("c", 1, 11, seq=0))
    for key, (_, planned, completed) in ages.items():
        rows(
            admin,
            f"UPDATE {s}.runs SET planned_at = now() - make_interval(days => %(p)s),"
            " completed_at = now() - make_interval(days => %(c)s) WHERE run_key = %(k)s",
            {"k": key, "p": planned, "c": completed},
        )
    assert ledger.prune(conn, "p", 90) == 2
    left = {r[0] for r in rows(admin, f"SELECT run_key FROM {s}.runs")}
    assert left == set(ages) - {"p@old", "p@old-done"}
    assert {r[0] for r in rows(admin, f"SELECT DISTINCT run_key FROM {s}.chunks")} == left
    assert ledger.prune(conn, "p", 90) == 0
    assert ledger.prune(conn, "q", 90) == 1
    assert ledger.policies(conn) == ["p"]


def test_a_version_4_ledger_gains_the_run_date_and_is_read_before_its_migration(
    schema: str, conn: Any, admin: Any
) -> None:
    """Version 5 records each run's date beside its cutoff. A ledger of version 4 is migrated by
    ensure(), keeping its rows (their run date unknown, NULL); before that, readers that never migrate
    (the CLI's status, the UI) read its runs without failing on the missing column."""
    ledger = Ledger(f"{schema}_ledger")
    s = ledger.s
    rows(admin, f"CREATE SCHEMA {s}")
    for step in range(1, 5):
        rows(admin, _MIGRATIONS[step].format(s=s))
    rows(
        admin,
        f"CREATE TABLE {s}.ledger_version (singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),"
        " version integer NOT NULL, migrated_at timestamptz NOT NULL DEFAULT now())",
    )
    rows(admin, f"INSERT INTO {s}.ledger_version (version) VALUES (4)")
    rows(
        admin,
        f"INSERT INTO {s}.runs (run_key, policy, target_table, cutoff, state, chunk_rows, batch_size,"
        " chunks_expected, rows_planned, planned_by) VALUES ('p@v4', 'p', 'public.t', %(c)s, 'planned', 10, 5, 1,"
        " 10, 'test')",
        {"c": CUTOFF},
    )
    # A version-4 mark of a detach that had only been started (set before DETACH ... CONCURRENTLY), on an
    # unfinished chunk, and one on a completed chunk.
    for chunk_key, state in (("detach:s.m01", "pending"), ("detach:s.m02", "complete")):
        rows(
            admin,
            f"INSERT INTO {s}.chunks (run_key, chunk_key, lo, hi, next_key, state, action, action_started_at)"
            " VALUES ('p@v4', %(k)s, 0, 1, 0, %(st)s, 'detach', now())",
            {"k": chunk_key, "st": state},
        )
    old_run = ledger_run(admin, ledger.schema, "p@v4")
    assert old_run is not None and "run_date" not in old_run
    read = ledger.get_run(conn, "p@v4")
    assert read is not None and read["run_date"] is None and read["cutoff"] == CUTOFF
    assert read["leaves_deferred"] is None
    assert [r["run_key"] for r in ledger.recent_runs(conn, "p")] == ["p@v4"]

    assert ledger.ensure(conn) == SCHEMA_VERSION == 8
    # From version 5 the mark means "this chunk's detach is its own": the old unfinished mark is no such
    # proof (a partition a DBA detached since would be dropped), so it is cleared; a finished one stays.
    marks = dict(rows(admin, f"SELECT chunk_key, action_started_at IS NOT NULL FROM {s}.chunks ORDER BY 1"))
    assert marks == {"detach:s.m01": False, "detach:s.m02": True}
    run = ledger_run(admin, ledger.schema, "p@v4")
    assert run is not None
    assert {k: run[k] for k in old_run} == old_run
    assert set(run) - set(old_run) == {"run_date", "leaves_deferred"} and run["run_date"] is None
    assert run["leaves_deferred"] is None  # version 7: not known for the runs recorded before
    run_date = CUTOFF + timedelta(days=30)  # a run of "30 days"
    with dbapi.transaction(conn) as cur:
        ledger.register_run(cur, dataclasses.replace(_record("q@v5", 0), run_date=run_date))
    stored = ledger.get_run(conn, "q@v5")
    assert stored is not None and stored["run_date"] == run_date
    assert scalar(admin, f"SELECT run_date FROM {s}.runs WHERE run_key = 'q@v5'") == run_date


def test_leaf_coverage_is_the_latest_cutoff_whose_run_completed_every_chunk_of_the_leaf(
    schema: str, conn: Any, admin: Any
) -> None:
    """What the planner carries leaves past the chunk budget over with: per leaf, the latest cutoff of a
    planned run of the policy (same mode) that completed every chunk of it; nothing without a ledger."""
    ledger = Ledger(f"{schema}_ledger")
    assert ledger.leaf_coverage(conn, "p", dry_run=False, oids=[1, 2]) == {}  # no ledger: read, nothing written
    assert ledger.version(conn) is None
    ledger.ensure(conn)
    day = timedelta(days=1)

    def run(key: str, cutoff: datetime, leaves: dict[int, list[str]], *, dry_run: bool = False) -> None:
        record = dataclasses.replace(_record(key, 0), policy="p", cutoff=cutoff, dry_run=dry_run)
        with dbapi.transaction(conn) as cur:
            ledger.register_run(cur, dataclasses.replace(record, leaves_deferred=("s.later",)), complete_if_empty=False)
            for oid, states in leaves.items():
                for i, _ in enumerate(states):
                    chunk = ChunkSpec(
                        f"blocks:{i}-{i + 1}@s.p{oid}", i, i + 1, partition=f"s.p{oid}", partition_oid=oid
                    )
                    ledger.insert_chunk(cur, key, chunk)
        for oid, states in leaves.items():
            for i, state in enumerate(states):
                rows(
                    admin,
                    f"UPDATE {ledger.s}.chunks SET state = %(st)s WHERE run_key = %(k)s AND chunk_key = %(c)s",
                    {"st": state, "k": key, "c": f"blocks:{i}-{i + 1}@s.p{oid}"},
                )

    run("p@1", CUTOFF, {1: ["complete"], 2: ["complete", "complete"], 3: ["complete"]})
    # A later run: leaf 1 complete, leaf 2 half done (not covered by it), leaf 3 not planned.
    run("p@2", CUTOFF + day, {1: ["complete"], 2: ["complete", "pending"]})
    run("p@3#lone", CUTOFF + 2 * day, {3: ["complete"]})  # a lone chunk's run covers nothing
    run("p@4#dry-run", CUTOFF + 3 * day, {2: ["complete"]}, dry_run=True)  # another mode
    assert ledger.leaf_coverage(conn, "p", dry_run=False, oids=[1, 2, 3, 4]) == {
        1: CUTOFF + day,
        2: CUTOFF,
        3: CUTOFF,
    }
    assert ledger.leaf_coverage(conn, "p", dry_run=True, oids=[1, 2]) == {2: CUTOFF + 3 * day}
    assert ledger.leaf_coverage(conn, "other", dry_run=False, oids=[1]) == {}
    # A chunk complete with a tenant left as an open dead letter did not purge its leaf: not covered by p@5;
    # once the letter is resolved, it is.
    run("p@5", CUTOFF + 4 * day, {1: ["complete"]})
    rows(
        admin,
        f"INSERT INTO {ledger.s}.dead_letters (run_key, chunk_key, tenant, cutoff, lo, hi, failure_class, message)"
        " VALUES ('p@5', 'blocks:0-1@s.p1', 'acme', now(), 0, 1, 'foreign key violation', 'm')",
    )
    assert ledger.leaf_coverage(conn, "p", dry_run=False, oids=[1])[1] == CUTOFF + day
    rows(admin, f"UPDATE {ledger.s}.dead_letters SET resolved_at = now()")
    assert ledger.leaf_coverage(conn, "p", dry_run=False, oids=[1])[1] == CUTOFF + 4 * day
    # The leaves a run deferred are read back as recorded, in order; NULL (not known) stays None.
    assert ledger.get_run(conn, "p@1")["leaves_deferred"] == ["s.later"]
    with dbapi.transaction(conn) as cur:
        ledger.register_run(cur, _record("q@none", 0))
    assert ledger.get_run(conn, "q@none")["leaves_deferred"] is None
