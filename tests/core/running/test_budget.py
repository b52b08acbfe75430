"""The database budget shared by the chunks of every purge on a database (:mod:`airflow_retention.core.running
.budget`), against the real PostgreSQL, in a database of its own (the batch slots are session-level advisory
locks of the whole database): workers on connections of their own never hold more batch slots than the budget
allows; a worker killed holding one loses it with its session, and the others take it; two policies share the
slots and the state; and the time a chunk pauses is recorded per reason, in the ledger and in its result.

The budget's state is forced here (``force``): a row claimed by nobody for an hour, so that no worker
observes and moves it while a test runs. The controller's moves are tests/core/running/test_controller.py's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from psycopg2.extensions import parse_dsn

from airflow_retention.core.errors import RetryableError
from airflow_retention.core.ledger.budget import SLOT_CLASS, TENANT_CLASS, TenantSlot
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.budget import SharedBudget
from airflow_retention.core.running.controller import DUTY_STEPS, SLOW_START, ladder, start_level
from airflow_retention.core.running.engine import BatchReport, ChunkResult, run_chunk
from airflow_retention.core.running.pacing import Pacer
from tests.conftest import _admin, connect, throwaway_database
from tests.core.helpers import (
    CUTOFF,
    create_events,
    eligible_ids,
    fill_events,
    ledger_chunks,
    make_policy,
    rows,
    scalar,
    start_and_join,
    wait_for,
)
from tests.core.running.test_engine import CHILD

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)
SLOTS_SQL = (
    "SELECT l.pid, l.objid::integer, a.application_name FROM pg_catalog.pg_locks l"
    " JOIN pg_catalog.pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND l.granted"
    " AND l.classid = %(k)s::bigint::oid AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
)
TENANT_SLOTS_SQL = (
    "SELECT pid FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND classid = %(k)s::bigint::oid"
    " AND objsubid = 2 AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
)
BUDGET = {"period": "200ms", "connection_reserve": 0}  # the test server's connections are every test's


@pytest.fixture(scope="module")
def budget_dsn() -> Iterator[str]:
    with throwaway_database("retention_budget") as dsn:
        yield dsn


@pytest.fixture
def db(budget_dsn: str) -> Iterator[Any]:
    """An autocommit psycopg2 connection to the budget's database, for setting up and inspecting."""
    conn = _admin(budget_dsn)
    yield conn
    conn.close()


@pytest.fixture
def schema(db: Any) -> Iterator[str]:
    name = f"b_{time.monotonic_ns() % 10**10}"
    rows(db, f'CREATE SCHEMA "{name}"')
    yield name
    rows(db, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    rows(db, f'DROP SCHEMA IF EXISTS "{name}_ledger" CASCADE')


def slots(db: Any) -> list[tuple[int, int, str]]:
    """The batch slots held on the database: (backend pid, slot, application_name)."""
    return [tuple(r) for r in rows(db, SLOTS_SQL, {"k": SLOT_CLASS})]  # type: ignore[misc]


def force(
    db: Any,
    policy: RetentionPolicy,
    level: int,
    *,
    paused: bool = False,
    reasons: Sequence[str] = (),
    causes: Sequence[str] = (),
) -> None:
    """Set the budget's state to a step of the policy's ladder, claimed for an hour: nobody observes it."""
    step = ladder(policy.budget.max_workers)[level]
    rows(
        db,
        f'INSERT INTO "{policy.ledger_schema}".budget_state (scope, level, concurrency, duty, paused, reasons,'
        " causes, baseline_ms, observed_at, claimed_until)"
        " VALUES ('database', %(level)s, %(c)s, %(duty)s, %(paused)s, %(reasons)s::text[], %(causes)s::text[], 1.0,"
        " clock_timestamp(), clock_timestamp() + interval '1 hour')"
        " ON CONFLICT (scope) DO UPDATE SET level = EXCLUDED.level, concurrency = EXCLUDED.concurrency,"
        " duty = EXCLUDED.duty, paused = EXCLUDED.paused, reasons = EXCLUDED.reasons, causes = EXCLUDED.causes,"
        " baseline_ms = EXCLUDED.baseline_ms, observed_at = EXCLUDED.observed_at,"
        " claimed_until = EXCLUDED.claimed_until",
        {
            "level": level,
            "c": step.concurrency,
            "duty": step.duty,
            "paused": paused,
            "reasons": list(reasons),
            "causes": list(causes),
        },
    )


def level_of(concurrency: int) -> int:
    """The ladder's step of ``concurrency`` batches at once, at full duty."""
    return start_level() + concurrency - 1


class Inside:
    """Counts the workers inside ``on_batch`` (after a batch's commit, before its slot is released): each one
    holds a batch slot. ``most[phase]``: the most at once in each phase of a test."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.lock = threading.Lock()
        self.now = 0
        self.phase = 0
        self.most: dict[int, int] = {}

    def __call__(self, report: BatchReport) -> None:
        with self.lock:
            self.now += 1
            self.most[self.phase] = max(self.most.get(self.phase, 0), self.now)
        time.sleep(self.hold_s)
        with self.lock:
            self.now -= 1


class SlotSampler(threading.Thread):
    """The batch slots held on the database, read every 10 ms on a connection of its own until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.samples: list[tuple[float, list[tuple[int, int, str]]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        conn = _admin(self.dsn)
        try:
            while not self.halt.is_set():
                self.samples.append((time.monotonic(), slots(conn)))
                self.halt.wait(0.01)
        finally:
            conn.close()

    def __enter__(self) -> SlotSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(10)

    def most(self, since: float = 0.0) -> int:
        return max((len(held) for t, held in self.samples if t >= since), default=0)


class Foreground(threading.Thread):
    """Another session at work: a statement every 20 ms on a connection of its own until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.halt = dsn, threading.Event()

    def run(self) -> None:
        conn = _admin(self.dsn)
        try:
            while not self.halt.is_set():
                rows(conn, "SELECT 1")
                self.halt.wait(0.02)
        finally:
            conn.close()

    def __enter__(self) -> Foreground:
        self.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(10)


def run_in_threads(
    dsn: str,
    jobs: Sequence[tuple[RetentionPolicy, ChunkSpec]],
    on_batch: Callable[[BatchReport], None],
    drivers: Sequence[str] = ("psycopg", "psycopg2"),
) -> tuple[dict[str, ChunkResult], list[BaseException]]:
    """Each chunk on a connection of its own, in a thread of its own, all started at once."""
    results: dict[str, ChunkResult] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def work(i: int, policy: RetentionPolicy, chunk: ChunkSpec) -> None:
        c = connect(drivers[i % len(drivers)], dsn)
        try:
            barrier.wait(timeout=30)
            results[f"{policy.name}/{chunk.key}"] = run_chunk(
                c, policy, CUTOFF, chunk, attempt=Attempt("d", "r", i, 1, f"worker-{i}"), on_batch=on_batch
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(i, p, c)) for i, (p, c) in enumerate(jobs)]
    start_and_join(threads, 120)
    return results, errors


def make_plan(db: Any, policy: RetentionPolicy) -> Any:
    """The run's plan, made on a connection of its own (the engine's leave autocommit for the batches)."""
    with closing(connect("psycopg2", db.dsn)) as conn:
        return plan_run(conn, policy, CUTOFF)


def events(db: Any, schema: str, table: str = "events", count: int = 4000) -> str:
    name = create_events(db, schema, table)
    fill_events(db, name, count)
    return name


def assert_purged_once(db: Any, policy: RetentionPolicy, table: str, eligible: int, total: int, run_key: str) -> None:
    """Every eligible row gone, each counted once in the ledger, nothing else gone."""
    assert eligible_ids(db, table) == []
    assert total - scalar(db, f"SELECT count(*) FROM {table}") == eligible
    chunks = ledger_chunks(db, policy.ledger_schema, run_key)
    assert all(c["state"] == "complete" for c in chunks)
    assert sum(c["rows_deleted"] for c in chunks) == eligible


# -- the slots --------------------------------------------------------------------------------------


def test_workers_on_connections_of_their_own_never_hold_more_slots_than_the_budget(
    db: Any, schema: str, budget_dsn: str
) -> None:
    table = events(db, schema)
    policy = make_policy(schema, batch_size=50, chunk_rows=520, budget=BUDGET)
    plan = make_plan(db, policy)
    assert len(plan.chunks) == 4
    eligible, total = len(eligible_ids(db, table)), scalar(db, f"SELECT count(*) FROM {table}")
    force(db, policy, level_of(2))
    inside = Inside(0.02)
    with SlotSampler(budget_dsn) as sampler:
        results, errors = run_in_threads(budget_dsn, [(policy, c) for c in plan.chunks], inside)
    assert errors == []
    assert inside.most[0] == 2, "two workers were never inside a batch slot at once"
    assert sampler.most() == 2 and len(sampler.samples) > 20
    assert slots(db) == []  # every slot released
    assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    assert sum(r.rows_deleted for r in results.values()) == eligible
    assert all(r.batches > 5 for r in results.values())
    # Four workers for two slots: they waited, and the waits are recorded per chunk, in the ledger as in the
    # results (the reason: the budget is simply full).
    chunks = {c["chunk_key"]: c for c in ledger_chunks(db, policy.ledger_schema, plan.run_key)}
    assert sum(r.paused.get("slots", 0.0) for r in results.values()) > 0.05
    for name, result in results.items():
        assert set(result.paused) <= {"slots"}
        ledger = chunks[name.split("/", 1)[1]]["paused"]
        assert ledger.keys() == result.paused.keys()
        assert ledger.get("slots", 0.0) == pytest.approx(result.paused.get("slots", 0.0), abs=0.01)
    assert scalar(db, f'SELECT concurrency FROM "{policy.ledger_schema}".budget_state') == 2  # nobody moved it


def test_workers_sharing_one_slot_wait_past_give_up_after_without_giving_up(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """Four workers at one batch at a time each wait about three quarters of the purge: the budget shared,
    not the purge held. Beside pgbench at the floor, 10M rows, three of four gave up after 600 s of such
    waits, half an hour into the purge. Each batch here holds the slot 120 ms, so a worker queued behind
    another and a holder waits past the period (200 ms) and looks again: those waits, while the slot
    changes hands, do not count."""
    table = events(db, schema)
    policy = make_policy(schema, batch_size=50, chunk_rows=520, budget=BUDGET, throttle={"give_up_after": "200ms"})
    plan = make_plan(db, policy)
    assert len(plan.chunks) == 4
    eligible, total = len(eligible_ids(db, table)), scalar(db, f"SELECT count(*) FROM {table}")
    force(db, policy, level_of(1))
    results, errors = run_in_threads(budget_dsn, [(policy, c) for c in plan.chunks], Inside(0.12))
    assert errors == []
    assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    waited = sorted(r.paused.get("slots", 0.0) for r in results.values())
    assert waited[-1] > 0.4, waited  # twice give_up_after: counted as before, the worker would have given up
    assert slots(db) == []


def test_a_worker_queued_behind_a_long_rest_does_not_count_it_as_a_hung_holder(
    db: Any, schema: str, budget_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches that overran at a low duty cycle rest many periods holding their slot (at 0.5 % a 259 ms batch
    rests 51 s). The holder runs a statement every quarter period of its rest, so a worker queued behind it
    sees it alive: two policies sharing one slot, each batch resting 0.4 s (two periods), finish with
    give_up_after at 0.8 s. Without the heartbeat every wait behind a rest counted and one of them gave up."""
    tables = [events(db, schema, "events", 400), events(db, schema, "events2", 400)]
    policies = [
        make_policy(
            schema,
            name=name,
            table=f"{schema}.{table}",
            batch_size=50,
            chunk_rows=5000,
            max_duty_cycle=0.01,
            budget=BUDGET,
            throttle={"give_up_after": "800ms"},
        )
        for name, table in (("events_purge", "events"), ("other_purge", "events2"))
    ]
    plans = [make_plan(db, p) for p in policies]
    assert [len(p.chunks) for p in plans] == [1, 1]
    before = [(len(eligible_ids(db, t)), scalar(db, f"SELECT count(*) FROM {t}")) for t in tables]
    force(db, policies[0], level_of(1))  # the state of both: one ledger
    rest = Pacer.rest
    # Each batch rests as one of 4 ms at 1 % does (0.4 s), however fast it was on this server.
    monkeypatch.setattr(Pacer, "rest", lambda self, ms, duty=None, **kw: rest(self, max(ms, 4.0), duty, **kw))
    jobs = [(p, plan.chunks[0]) for p, plan in zip(policies, plans, strict=True)]
    results, errors = run_in_threads(budget_dsn, jobs, Inside(0))
    assert errors == []
    for policy, plan, table, (eligible, total) in zip(policies, plans, tables, before, strict=True):
        assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    waited = sorted(r.paused.get("slots", 0.0) for r in results.values())
    assert waited[-1] > 1.6, waited  # twice give_up_after behind the other's rests, none of it counted
    assert slots(db) == []


def test_a_worker_waiting_on_a_slot_nobody_gives_back_gives_up_naming_its_holder(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """A session that keeps the only batch slot (a worker hung mid-rest, say): the waits count, and the chunk
    stops past give_up_after naming the session to look at, having deleted nothing."""
    table = events(db, schema, count=200)
    policy = make_policy(schema, budget=BUDGET, throttle={"give_up_after": "300ms"})
    (chunk,) = make_plan(db, policy).chunks
    force(db, policy, level_of(1))
    before = scalar(db, f"SELECT count(*) FROM {table}")
    with closing(_admin(budget_dsn)) as holder:
        assert rows(holder, "SELECT pg_try_advisory_lock(%(k)s::integer, 0)", {"k": SLOT_CLASS}) == [(True,)]
        pid = rows(holder, "SELECT pg_backend_pid()")[0][0]
        with closing(connect("psycopg", budget_dsn)) as conn, pytest.raises(RetryableError) as caught:
            run_chunk(conn, policy, CUTOFF, chunk)
    message = str(caught.value)
    assert f"waiting for a batch slot (slots), the slots held throughout by backend pid(s) {pid} for" in message
    assert "give_up_after 0.3 s" in message and "retry resumes the chunk" in message
    assert scalar(db, f"SELECT count(*) FROM {table}") == before


def test_a_give_up_names_the_holders_of_the_last_wait_only_if_it_counted(db: Any, schema: str, budget_dsn: str) -> None:
    """The sessions a give-up names held the slots through the last wait, none of them having run a
    statement: after a wait in which the holder ran one (not counted), no session is named."""
    events(db, schema, count=200)
    policy = make_policy(schema, budget=BUDGET)  # a wait of a period: 200 ms
    make_plan(db, policy)
    budget = SharedBudget(policy, Ledger(policy.ledger_schema), "chunk x", "test")
    with closing(_admin(budget_dsn)) as holder, closing(connect("psycopg2", budget_dsn)) as conn:
        assert rows(holder, "SELECT pg_try_advisory_lock(%(k)s::integer, 0)", {"k": SLOT_CLASS}) == [(True,)]
        pid = rows(holder, "SELECT pg_backend_pid()")[0][0]
        assert not budget._wait(conn, 0, "slots")  # the holder ran nothing meanwhile: counted
        assert budget._stuck() == f", the slots held throughout by backend pid(s) {pid}"
        held = budget.held_s
        statement = threading.Timer(0.05, lambda: rows(holder, "SELECT 1"))
        statement.start()
        assert not budget._wait(conn, 0, "slots")  # the holder ran a statement meanwhile: not counted
        statement.join()
        assert budget.held_s == held and budget._stuck() == ""


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_worker_queued_for_a_slot_holds_no_snapshot_longer_than_a_slice_and_takes_the_slot_when_given_back(
    db: Any, budget_dsn: str, driver: str
) -> None:
    """A session queued for a lock holds its statement's snapshot, and with it the database's xmin horizon,
    for as long as it waits: the wait for a slot is cut into statements of at most WAIT_SLICE_MS. Sampled
    through a 2 s wait on a slot another session keeps, the waiter's statement is never much older than a
    slice, and the wait ends without the slot after its 2 s; given back in the middle of a second wait, the
    slot is taken at once."""
    ledger = Ledger("no_ledger")  # the slots are advisory locks: no table of the ledger is read
    with closing(_admin(budget_dsn)) as holder, closing(connect(driver, budget_dsn)) as conn:
        assert rows(holder, "SELECT pg_try_advisory_lock(%(k)s::integer, 5)", {"k": SLOT_CLASS}) == [(True,)]
        waiter = rows(conn, "SELECT pg_backend_pid()")[0][0]
        conn.commit()
        outcome: list[tuple[bool, float]] = []

        def wait(timeout_ms: int) -> None:
            started = time.monotonic()
            outcome.append((ledger.wait_slot(conn, 5, timeout_ms), time.monotonic() - started))

        thread = threading.Thread(target=wait, args=(2000,))
        thread.start()
        ages = []
        while thread.is_alive():
            ages += rows(
                db,
                "SELECT extract(epoch FROM clock_timestamp() - query_start)::float8 FROM pg_catalog.pg_stat_activity"
                " WHERE pid = %(p)s AND wait_event_type = 'Lock' AND backend_xmin IS NOT NULL",
                {"p": waiter},
            )
            time.sleep(0.05)
        thread.join()
        (taken, waited), *_ = outcome
        assert not taken and 1.9 <= waited < 3.0
        assert len(ages) >= 10 and max(age for (age,) in ages) < 0.5, ages

        thread = threading.Thread(target=wait, args=(10_000,))
        thread.start()
        time.sleep(0.5)
        given_back = time.monotonic()
        assert rows(holder, "SELECT pg_advisory_unlock(%(k)s::integer, 5)", {"k": SLOT_CLASS}) == [(True,)]
        thread.join()
        taken, _ = outcome[1]
        assert taken and time.monotonic() - given_back < 1.0
        assert (waiter, 5) in [(pid, slot) for pid, slot, _ in slots(db)]
        ledger.release_slot(conn, 5)


def test_a_worker_killed_holding_a_slot_loses_it_and_the_others_take_it(
    db: Any, schema: str, budget_dsn: str, tmp_path: Path
) -> None:
    table = events(db, schema, count=6000)
    policy = make_policy(schema, batch_size=50, chunk_rows=1100, budget=BUDGET)
    plan = make_plan(db, policy)
    assert len(plan.chunks) == 3
    eligible, total = len(eligible_ids(db, table)), scalar(db, f"SELECT count(*) FROM {table}")
    force(db, policy, level_of(2))
    victim, others = plan.chunks[0], plan.chunks[1:]
    app = f"retention-budget-kill-{schema}"
    # The child commits its first batch and then holds its slot (a long on_batch) until it is killed.
    args = {
        "driver": "psycopg2",
        "dsn": budget_dsn,
        "app": app,
        "policy": policy_to_dict(policy),
        "cutoff": CUTOFF.isoformat(),
        "chunk": {"key": victim.key, "lo": victim.lo, "hi": victim.hi, "seq": victim.seq},
        "sleep": 120,
    }
    stderr = tmp_path / "child.err"
    with stderr.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err
        )
    inside = Inside(0.04)
    outcome: dict[str, Any] = {}
    try:

        def holds_a_slot() -> bool:
            assert child.poll() is None, f"child exited early: {stderr.read_text()}"
            return any(a == app for _, _, a in slots(db))

        wait_for(holds_a_slot, 30, "the child to hold a batch slot")
        (child_pid, child_slot) = next((pid, slot) for pid, slot, a in slots(db) if a == app)
        with SlotSampler(budget_dsn) as sampler:
            worker = threading.Thread(
                target=lambda: outcome.update(
                    zip(
                        ("results", "errors"),
                        run_in_threads(budget_dsn, [(policy, c) for c in others], inside),
                        strict=True,
                    )
                )
            )
            worker.start()
            # While the child holds one slot, the two others share the other one.
            wait_for(
                lambda: sum(c["batches"] for c in ledger_chunks(db, policy.ledger_schema, plan.run_key)[1:]) >= 6,
                30,
                "the others to commit batches beside the child",
            )
            assert inside.most[0] == 1 and any(a == app for _, _, a in slots(db))
            inside.phase = 1
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
            gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = %(p)s"
            wait_for(lambda: scalar(db, gone, {"p": child_pid}) == 0, 15, "the killed session to end")
            ended = time.monotonic()
            worker.join(120)
        assert not worker.is_alive() and outcome["errors"] == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # Never more than the budget's two slots; after the kill, its slot back in use and both slots busy again.
    assert sampler.most() == 2
    after = [held for t, held in sampler.samples if t >= ended]
    assert all(pid != child_pid for held in after for pid, _, _ in held)
    assert max(len(held) for held in after) == 2, "the killed worker's slot was lost"
    assert any(slot == child_slot for held in after for _, slot, _ in held)
    assert inside.most[1] == 2
    # The killed chunk: one batch committed; its retry resumes and finishes it.
    (first,) = [c for c in ledger_chunks(db, policy.ledger_schema, plan.run_key) if c["chunk_key"] == victim.key]
    assert (first["state"], first["batches"]) == ("running", 1)
    with closing(connect("psycopg", budget_dsn)) as conn:
        retry = run_chunk(conn, policy, CUTOFF, victim, attempt=Attempt("d", "r", 0, 2, "retry"))
    assert retry.resumed_from == first["next_key"] and retry.batches > 1
    assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    assert slots(db) == []


def test_a_session_terminated_mid_batch_frees_the_only_slot_for_the_worker_waiting(
    db: Any, schema: str, budget_dsn: str
) -> None:
    table = events(db, schema)
    policy = make_policy(schema, batch_size=50, chunk_rows=1100, budget=BUDGET)
    plan = make_plan(db, policy)
    assert len(plan.chunks) == 2
    eligible, total = len(eligible_ids(db, table)), scalar(db, f"SELECT count(*) FROM {table}")
    force(db, policy, level_of(1))  # one slot for both
    victim, other = plan.chunks
    # A row of the victim's second batch, held: the victim waits inside that batch, holding the only slot.
    (held_row,) = rows(
        db, f"SELECT id FROM {table} WHERE id >= %(lo)s ORDER BY id OFFSET 75 LIMIT 1", {"lo": victim.lo}
    )
    blocker = connect("psycopg2", budget_dsn)
    outcome: dict[str, Any] = {}
    try:
        with blocker.cursor() as cur:
            cur.execute(f"SELECT 1 FROM {table} WHERE id = %(id)s FOR UPDATE", {"id": held_row[0]})

        def attempt(chunk: ChunkSpec, app: str) -> None:
            c = connect("psycopg", budget_dsn)
            try:
                c.execute("SELECT set_config('application_name', %s, false)", (app,))
                c.commit()
                outcome[app] = run_chunk(c, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 1, app))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome[app] = exc
            finally:
                c.close()

        first = threading.Thread(target=attempt, args=(victim, f"victim-{schema}"))
        first.start()
        waiting = (
            f"SELECT pid FROM pg_stat_activity WHERE application_name = 'victim-{schema}' AND wait_event_type = 'Lock'"
        )
        wait_for(lambda: bool(rows(db, waiting)), 30, "the victim to wait inside its second batch")
        ((victim_pid,),) = rows(db, waiting)
        assert [(pid, a) for pid, _, a in slots(db)] == [(victim_pid, f"victim-{schema}")]
        second = threading.Thread(target=attempt, args=(other, f"other-{schema}"))
        second.start()
        queued = f"SELECT 1 FROM pg_stat_activity WHERE application_name = 'other-{schema}' AND wait_event = 'advisory'"
        wait_for(lambda: bool(rows(db, queued)), 30, "the other to queue for the slot")
        time.sleep(0.6)  # three periods: the other waits for the slot, and commits nothing
        (other_row,) = [c for c in ledger_chunks(db, policy.ledger_schema, plan.run_key) if c["chunk_key"] == other.key]
        assert other_row["batches"] == 0
        assert rows(db, "SELECT pg_terminate_backend(%(p)s)", {"p": victim_pid}) == [(True,)]
        first.join(30)
        second.join(60)
    finally:
        blocker.rollback()
        blocker.close()
    assert isinstance(outcome[f"victim-{schema}"], RetryableError)
    done = outcome[f"other-{schema}"]
    assert isinstance(done, ChunkResult) and done.paused.get("slots", 0.0) >= 0.5
    chunks = {c["chunk_key"]: c for c in ledger_chunks(db, policy.ledger_schema, plan.run_key)}
    assert chunks[other.key]["state"] == "complete"
    assert chunks[other.key]["paused"]["slots"] == pytest.approx(done.paused["slots"], abs=0.01)
    assert chunks[victim.key]["batches"] == 1
    with closing(connect("psycopg2", budget_dsn)) as conn:
        retry = run_chunk(conn, policy, CUTOFF, victim, attempt=Attempt("d", "r", 0, 2, "retry"))
    assert retry.resumed_from == chunks[victim.key]["next_key"]
    assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    assert slots(db) == []


# -- two policies -----------------------------------------------------------------------------------


def two_policies(db: Any, schema: str) -> tuple[list[RetentionPolicy], list[str]]:
    """Two policies on two tables of the database, with one ledger: one budget."""
    tables = [events(db, schema, "events", 3000), events(db, schema, "events2", 3000)]
    policies = [
        make_policy(schema, batch_size=50, chunk_rows=5000, budget=BUDGET),
        make_policy(
            schema, name="other_purge", table=f"{schema}.events2", batch_size=50, chunk_rows=5000, budget=BUDGET
        ),
    ]
    return policies, tables


def test_two_policies_on_one_database_share_the_slots(db: Any, schema: str, budget_dsn: str) -> None:
    policies, tables = two_policies(db, schema)
    plans = [make_plan(db, p) for p in policies]
    assert [len(p.chunks) for p in plans] == [1, 1]
    before = [(len(eligible_ids(db, t)), scalar(db, f"SELECT count(*) FROM {t}")) for t in tables]
    force(db, policies[0], level_of(1))  # the state of both: one ledger
    inside = Inside(0.01)
    with SlotSampler(budget_dsn) as sampler:
        results, errors = run_in_threads(
            budget_dsn, [(p, plan.chunks[0]) for p, plan in zip(policies, plans, strict=True)], inside
        )
    assert errors == []
    # One slot: a batch of one policy never beside a batch of the other, and each waited for the other's.
    assert inside.most[0] == 1 and sampler.most() == 1
    assert all(r.paused.get("slots", 0.0) > 0 for r in results.values()), {k: r.paused for k, r in results.items()}
    assert scalar(db, f'SELECT count(*) FROM "{policies[0].ledger_schema}".budget_state') == 1
    for policy, plan, table, (eligible, total) in zip(policies, plans, tables, before, strict=True):
        assert_purged_once(db, policy, table, eligible, total, plan.run_key)


def test_a_second_policy_carries_on_the_budget_the_first_one_observed(db: Any, schema: str, budget_dsn: str) -> None:
    policies, _ = two_policies(db, schema)
    plans = [make_plan(db, p) for p in policies]
    observations = (
        "SELECT split_part(observer, '@', 1), level, baseline_ms, move"
        f' FROM "{schema}_ledger".budget_observations ORDER BY at'
    )
    with closing(connect("psycopg2", budget_dsn)) as conn:
        first = run_chunk(conn, policies[0], CUTOFF, plans[0].chunks[0], on_batch=lambda r: time.sleep(0.02))
    seen = rows(db, observations)
    assert first.batches > 10 and seen and {o[0] for o in seen} == {"events_purge"}
    state = rows(db, f'SELECT level, baseline_ms, observer, baseline_at FROM "{schema}_ledger".budget_state')
    time.sleep(0.25)  # the next period is due
    with closing(connect("psycopg", budget_dsn)) as conn:
        run_chunk(conn, policies[1], CUTOFF, plans[1].chunks[0], on_batch=lambda r: time.sleep(0.02))
    more = rows(db, observations)[len(seen) :]
    # The second policy's chunks observed the same state: from the level the first left, with its baseline
    # (not measured again; only ever lowered to the canary's recent median).
    assert more and {o[0] for o in more} == {"other_purge"}
    assert all(o[2] <= state[0][1] for o in more)
    assert scalar(db, f'SELECT baseline_at FROM "{schema}_ledger".budget_state') == state[0][3]
    assert more[0][1] in (state[0][0] - 1, state[0][0], state[0][0] + 1)
    assert scalar(db, f'SELECT count(*) FROM "{schema}_ledger".budget_state') == 1


# -- the tenant ceiling -----------------------------------------------------------------------------


class InsideByTenant(Inside):
    """:class:`Inside`, also per tenant: ``most_of[tenant]``, the most batches of one tenant at once."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(hold_s)
        self.of: dict[str | None, int] = {}
        self.most_of: dict[str | None, int] = {}

    def __call__(self, report: BatchReport) -> None:
        with self.lock:
            self.of[report.tenant] = self.of.get(report.tenant, 0) + 1
            self.most_of[report.tenant] = max(self.most_of.get(report.tenant, 0), self.of[report.tenant])
        super().__call__(report)
        with self.lock:
            self.of[report.tenant] -= 1


def test_one_big_tenants_chunks_never_hold_more_batch_slots_than_its_ceiling(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """A tenant cut into several chunks (``max_workers_per_tenant`` 1) runs one batch at a time, while the
    other tenants' chunk takes the free slots beside it; its chunks' waits are recorded as ``tenant_ceiling``."""
    table = create_events(db, schema)
    fill_events(db, table, 3000, tenant="1")
    fill_events(db, table, 600, first_id=3001, tenant="2 + mod(g, 3)")  # three small tenants: one chunk
    policy = make_policy(
        schema,
        tenant_column="tenant_id",
        batch_size=40,
        chunk_rows=500,
        budget={**BUDGET, "max_workers_per_tenant": 1},
    )
    plan = make_plan(db, policy)
    big = [c for c in plan.chunks if c.tenants == ("1",)]
    assert len(big) >= 3 and len(plan.chunks) > len(big), [c.key for c in plan.chunks]
    eligible, total = len(eligible_ids(db, table)), scalar(db, f"SELECT count(*) FROM {table}")
    force(db, policy, level_of(4))
    inside = InsideByTenant(0.02)
    results, errors = run_in_threads(budget_dsn, [(policy, c) for c in plan.chunks], inside)
    assert errors == []
    assert inside.most_of["1"] == 1, "two batches of tenant 1 ran at once"
    assert inside.most[0] >= 2, "no other tenant's batch ran beside tenant 1's"
    assert_purged_once(db, policy, table, eligible, total, plan.run_key)
    assert slots(db) == [] and rows(db, TENANT_SLOTS_SQL, {"k": TENANT_CLASS}) == []  # every slot released
    # The big tenant's chunks waited for each other, and say so; the small tenants' chunk never did.
    waited = {key.split("/", 1)[1]: r.paused.get("tenant_ceiling", 0.0) for key, r in results.items()}
    assert sum(waited[c.key] for c in big) > 0.05, waited
    assert all(waited[c.key] == 0.0 for c in plan.chunks if c not in big), waited
    ledger = {c["chunk_key"]: c["paused"] for c in ledger_chunks(db, policy.ledger_schema, plan.run_key)}
    for chunk in big:
        assert ledger[chunk.key].get("tenant_ceiling", 0.0) == pytest.approx(waited[chunk.key], abs=0.01)


def one_tenant_of_one_slot(db: Any, schema: str) -> tuple[str, RetentionPolicy, Any, int]:
    """Tenant 1's rows, a policy of one slot per tenant giving up after 300 ms, its plan, and the table's
    row count before any chunk ran."""
    table = create_events(db, schema)
    fill_events(db, table, 2000, tenant="1")
    policy = make_policy(
        schema,
        tenant_column="tenant_id",
        batch_size=40,
        chunk_rows=400,
        throttle={"give_up_after": "300ms"},
        budget={**BUDGET, "max_workers_per_tenant": 1},
    )
    plan = make_plan(db, policy)
    force(db, policy, level_of(4))
    return table, policy, plan, scalar(db, f"SELECT count(*) FROM {table}")


@pytest.mark.parametrize("spelling", ["as the policy", "unqualified"])
def test_a_tenant_chunk_waiting_past_give_up_after_fails_naming_its_tenant_and_holds_no_slot(
    db: Any, schema: str, budget_dsn: str, spelling: str
) -> None:
    """Another worker holds the tenant's only slot, its policy naming the table as this one does or
    unqualified (found on its ``search_path``): one table, one ceiling, whatever the spelling."""
    table, policy, plan, before = one_tenant_of_one_slot(db, schema)
    holder = TenantSlot(policy.table.sql if spelling == "as the policy" else '"events"', "1", 0)
    with closing(connect("psycopg2", budget_dsn)) as other:
        other.autocommit = True
        with other.cursor() as cur:
            cur.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
        assert Ledger(policy.ledger_schema).try_slot(other, holder)  # another worker's batch of tenant 1
        with closing(connect("psycopg", budget_dsn)) as conn, pytest.raises(RetryableError) as caught:
            run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    message = str(caught.value)
    assert "waiting for a slot of tenant 1 (max_workers_per_tenant 1)" in message, message
    assert "give_up_after 0.3 s" in message and "retry resumes the chunk" in message
    assert scalar(db, f"SELECT count(*) FROM {table}") == before  # nothing deleted
    assert slots(db) == [] and rows(db, TENANT_SLOTS_SQL, {"k": TENANT_CLASS}) == []
    chunk = {c["chunk_key"]: c for c in ledger_chunks(db, policy.ledger_schema, plan.run_key)}[plan.chunks[0].key]
    assert chunk["paused"].get("tenant_ceiling", 0.0) >= 0.3


def test_a_tenant_waiter_gives_up_on_its_tenants_hung_slot_while_other_tenants_batches_go_on(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """The tenant's only slot is held by a session that runs nothing (a worker hung mid-rest) while another
    tenant's slot changes hands all the time: the waits count, because nothing moved among its own tenant's
    slots. Compared over all slots of the database, the other tenant's batches hid the hung holder and the
    chunk waited for as long as they went on."""
    table, policy, plan, before = one_tenant_of_one_slot(db, schema)
    ledger = Ledger(policy.ledger_schema)
    stop, churns = threading.Event(), [0]

    def churn() -> None:  # another worker's batches of tenant 2, one after another, for at most 20 s
        with closing(connect("psycopg2", budget_dsn)) as other:
            other.autocommit = True
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                assert ledger.try_slot(other, TenantSlot(policy.table.sql, "2", 0))
                time.sleep(0.02)
                ledger.release_slot(other, TenantSlot(policy.table.sql, "2", 0))
                churns[0] += 1

    churner = threading.Thread(target=churn, daemon=True)
    with closing(connect("psycopg2", budget_dsn)) as hung:
        hung.autocommit = True
        pid = rows(hung, "SELECT pg_backend_pid()")[0][0]
        assert ledger.try_slot(hung, TenantSlot(policy.table.sql, "1", 0))
        churner.start()
        try:
            with closing(connect("psycopg", budget_dsn)) as conn, pytest.raises(RetryableError) as caught:
                run_chunk(conn, policy, CUTOFF, plan.chunks[0])
            # Given up while the other tenant's batches still went on, not once they stopped.
            assert churner.is_alive() and churns[0] > 0, churns
        finally:
            stop.set()
            churner.join()
    message = str(caught.value)
    assert "waiting for a slot of tenant 1 (max_workers_per_tenant 1)" in message, message
    assert f"the slots held throughout by backend pid(s) {pid} for" in message, message
    assert scalar(db, f"SELECT count(*) FROM {table}") == before  # nothing deleted
    assert slots(db) == [] and rows(db, TENANT_SLOTS_SQL, {"k": TENANT_CLASS}) == []


def test_the_wal_rate_beside_a_foreground_steps_the_budget_down_and_is_recorded(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """The purge's WAL against a max_wal_rate it cannot stay below, while another session works: the budget
    steps down, saying so, and each observation keeps the WAL position the next one measures from."""
    table = events(db, schema, count=6000)
    policy = make_policy(schema, batch_size=100, budget={**BUDGET, "max_wal_rate": 0.05})
    plan = make_plan(db, policy)
    with Foreground(budget_dsn), closing(connect("psycopg", budget_dsn)) as conn:
        result = run_chunk(conn, policy, CUTOFF, plan.chunks[0], on_batch=lambda r: time.sleep(0.01))
    seen = rows(
        db,
        "SELECT move, reasons, (signals -> 'wal_rate' ->> 'value')::float8, signals -> 'wal_rate' ->> 'lsn'"
        f' FROM "{policy.ledger_schema}".budget_observations ORDER BY at',
    )
    assert len(seen) >= 3, seen
    assert all(lsn for *_, lsn in seen)
    assert seen[0][2] is None  # the first observation has one position, no rate yet
    downs = [s for s in seen if s[0] == "down"]
    assert downs and all(any(r.startswith("wal_rate ") and "> 0.05MB/s" in r for r in s[1]) for s in downs), seen
    assert all(s[2] > 0.05 for s in downs)
    assert result.paused.get("wal_rate", 0) > 0, result.paused
    assert eligible_ids(db, table) == []


@pytest.mark.parametrize(("recent_ms", "expected_ms"), [(1.0, 1.0), (100.0, 50.0)])
def test_the_baseline_goes_down_to_the_canarys_recent_median_and_never_up(
    db: Any, schema: str, budget_dsn: str, recent_ms: float, expected_ms: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A baseline of 50 ms measured while the database was slow, and twenty periods since whose canary read
    1 ms: the next observation lowers it to that median and says so, and the thresholds follow. Canaries
    above it (a purge at work) never raise it within a run."""
    events(db, schema, count=200)
    policy = make_policy(schema, batch_size=50, budget=BUDGET)
    (chunk,) = make_plan(db, policy).chunks
    force(db, policy, level_of(1))
    ledger = f'"{policy.ledger_schema}"'
    rows(
        db,
        f"UPDATE {ledger}.budget_state SET baseline_ms = 50, baseline_at = clock_timestamp() - interval '10 s',"
        " observed_at = clock_timestamp() - interval '1 s', claimed_until = NULL",
    )
    rows(
        db,
        f"INSERT INTO {ledger}.budget_observations (at, scope, level, concurrency, duty, paused, move, canary_ms,"
        " baseline_ms, signals, reasons)"
        " SELECT clock_timestamp() - make_interval(secs => g * 0.2), 'database', %(level)s, 1, 1, false, 'hold',"
        " %(canary)s, 50, '{}', '{}' FROM generate_series(1, 20) g",
        {"level": level_of(1), "canary": recent_ms},
    )
    caplog.set_level("INFO", logger="airflow_retention.core.running.budget")
    with closing(connect("psycopg", budget_dsn)) as conn:
        run_chunk(conn, policy, CUTOFF, chunk)
    seen = rows(
        db,
        f"SELECT baseline_ms, canary_ms FROM {ledger}.budget_observations WHERE observer IS NOT NULL ORDER BY at",
    )
    assert seen and all(b == pytest.approx(expected_ms) for b, _ in seen), seen
    assert scalar(db, f"SELECT baseline_ms FROM {ledger}.budget_state") == pytest.approx(expected_ms)
    lowered = [r.getMessage() for r in caplog.records if "baseline lowered" in r.getMessage()]
    if recent_ms < 50:
        assert lowered and "lowered from 50.00 to 1.00 ms: the canary's median over the last 20 periods" in lowered[0]
    else:
        assert lowered == []


# -- pauses per reason ------------------------------------------------------------------------------


def test_a_budget_starting_beside_another_session_starts_slow_and_says_why(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """No state yet and a session at work: the first observation puts the budget at SLOW_START (busy 10 %),
    not at full speed, with the reason recorded; the rests that follow are accounted to ``slow_start``."""
    table = events(db, schema, count=1500)
    policy = make_policy(schema, batch_size=100, budget={**BUDGET, "period": "5s"})
    plan = make_plan(db, policy)
    with Foreground(budget_dsn), closing(connect("psycopg2", budget_dsn)) as conn:
        result = run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    first = rows(
        db,
        f"SELECT level, duty, move, reasons, signals -> 'foreground_sessions' ->> 'value'"
        f' FROM "{policy.ledger_schema}".budget_observations ORDER BY at LIMIT 1',
    )[0]
    assert first[0] == SLOW_START and first[1] == pytest.approx(0.1) and first[2] == "hold", first
    assert int(first[4]) >= 1 and first[3][0] == f"slow start: {first[4]} other session(s) at work", first
    assert result.batches >= 8 and set(result.paused) == {"slow_start"}
    assert result.paused["slow_start"] == pytest.approx(result.duty_seconds, abs=0.01)
    batch_s = sum(b.ms for b in result.batch_log[:-1]) / 1000
    assert result.duty_seconds == pytest.approx(batch_s * 9, rel=0.05)  # busy 10 %: rests nine times a batch
    assert eligible_ids(db, table) == []


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_sessions_in_ignored_databases_are_no_foreground(db: Any, budget_dsn: str, driver: str) -> None:
    """``ignore_databases`` (Airflow's metadata database on the target's server): a session at work there
    is not counted as an application to yield to; the other databases' sessions still are."""
    ledger = Ledger("never_created_ledger")  # the count reads pg_stat_activity only

    def databases(*leaving_out: str) -> list[str]:
        return [r[0] for r in rows(db, "SELECT datname FROM pg_database") if r[0] not in leaving_out]

    with throwaway_database("retention_metadata") as metadata_dsn, Foreground(metadata_dsn):
        metadata = parse_dsn(metadata_dsn)["dbname"]
        with closing(connect(driver, budget_dsn)) as conn:
            # Every database ignored but the metadata one: its scheduler-like session is the one counted.
            assert ledger.foreground_sessions(conn, 5.0, databases(metadata)) >= 1
            # Every database ignored, the metadata one too: nobody is at work.
            assert ledger.foreground_sessions(conn, 5.0, databases()) == 0
            assert ledger.foreground_sessions(conn, 5.0) >= 1  # nothing ignored: the default


@pytest.mark.parametrize(
    ("level", "causes", "max_duty_cycle", "reason"),
    [
        (DUTY_STEPS.index(0.1), [], 1.0, "budget"),  # busy a tenth of the time, no signal named
        (DUTY_STEPS.index(0.2), ["canary_latency"], 1.0, "canary_latency"),
        (level_of(1), [], 0.25, "max_duty_cycle"),  # the policy's own duty cycle, below the budget's
    ],
)
def test_the_rest_of_a_low_duty_cycle_is_recorded_under_its_reason(
    db: Any, schema: str, budget_dsn: str, level: int, causes: list[str], max_duty_cycle: float, reason: str
) -> None:
    table = events(db, schema, count=1500)
    policy = make_policy(schema, batch_size=100, budget=BUDGET, max_duty_cycle=max_duty_cycle)
    plan = make_plan(db, policy)
    force(db, policy, level, causes=causes)
    with closing(connect("psycopg2", budget_dsn)) as conn:
        result = run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    assert result.batches >= 8
    assert set(result.paused) == {reason}
    assert result.paused[reason] == pytest.approx(result.duty_seconds, abs=0.01)
    duty = min(max_duty_cycle, ladder(4)[level].duty)
    batch_s = sum(b.ms for b in result.batch_log[:-1]) / 1000  # every batch but the last is followed by a rest
    assert result.duty_seconds == pytest.approx(batch_s * (1 / duty - 1), rel=0.05)
    (chunk,) = ledger_chunks(db, policy.ledger_schema, plan.run_key)
    assert chunk["paused"] == {reason: pytest.approx(result.paused[reason], abs=0.01)}
    assert eligible_ids(db, table) == []


def test_a_paused_budget_holds_the_chunk_records_why_and_gives_up_past_give_up_after(
    db: Any, schema: str, budget_dsn: str
) -> None:
    table = events(db, schema, count=1500)
    policy = make_policy(schema, batch_size=100, budget=BUDGET, throttle={"give_up_after": "600ms"})
    plan = make_plan(db, policy)
    (chunk,) = plan.chunks
    force(db, policy, level_of(1))
    lag = "replica_lag 45000ms > 30000ms"

    committed: list[BatchReport] = []

    def pause_after_two(report: BatchReport) -> None:
        committed.append(report)
        time.sleep(0.03)  # the chunk's 15 batches outlast the half period the state is read again after
        if len(committed) == 2:
            force(db, policy, level_of(1), paused=True, reasons=[lag], causes=["replica_lag"])

    started = time.monotonic()
    with closing(connect("psycopg2", budget_dsn)) as conn, pytest.raises(RetryableError) as info:
        run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 1, "first"), on_batch=pause_after_two)
    waited = time.monotonic() - started
    message = str(info.value)
    assert f"paused: {lag}" in message and "give_up_after 0.6 s" in message, message
    assert "the task's retry resumes the chunk" in message
    assert waited >= 0.6
    (row,) = ledger_chunks(db, policy.ledger_schema, plan.run_key)
    # The state is read again at most every half period (100 ms here): a few batches more before the pause.
    assert row["state"] == "running" and row["batches"] == len(committed) >= 2
    # The pause is in the ledger, under its cause: "throttled on purpose", not "stuck".
    assert row["paused"].get("replica_lag", 0.0) >= 0.6
    assert lag in row["last_error"]
    # Paused no more: the retry finishes the chunk, the pause of the first attempt still counted.
    force(db, policy, level_of(1))
    with closing(connect("psycopg", budget_dsn)) as conn:
        retry = run_chunk(conn, policy, CUTOFF, chunk, attempt=Attempt("d", "r", 0, 2, "retry"))
    assert retry.paused == {}
    (row,) = ledger_chunks(db, policy.ledger_schema, plan.run_key)
    assert row["state"] == "complete" and row["paused"]["replica_lag"] >= 0.6
    assert eligible_ids(db, table) == []


def test_a_worker_that_gets_its_slot_as_give_up_after_runs_out_keeps_it_and_goes_on(
    db: Any, schema: str, budget_dsn: str
) -> None:
    """The wait for a slot ends with the slot at the moment the attempt's pauses reach ``give_up_after``: the
    attempt goes on with it; it never gives up holding a slot that nothing would release before its session
    ends (a connection kept by the worker keeps the slot)."""
    events(db, schema, count=200)
    policy = make_policy(schema, budget=BUDGET)
    make_plan(db, policy)
    force(db, policy, level_of(1))
    holder = _admin(budget_dsn)
    ticks = iter(range(0, 10**6, 1000))  # every reading of the clock 1000 s later: past give_up_after (600 s)
    budget = SharedBudget(policy, Ledger(policy.ledger_schema), "chunk x", "test", clock=lambda: float(next(ticks)))
    try:
        assert rows(holder, "SELECT pg_try_advisory_lock(%(k)s::integer, 0)", {"k": SLOT_CLASS}) == [(True,)]

        def let_go_once_queued() -> None:
            # Only once the worker waits on the slot: a fixed delay let it go first on a loaded machine.
            deadline = time.monotonic() + 60
            while not rows(
                holder,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND classid = %(k)s::bigint::oid"
                # This database's: other tests' workers queue on slots of their own databases.
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                {"k": SLOT_CLASS},
            )[0][0]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            rows(holder, "SELECT pg_advisory_unlock_all()")

        threading.Thread(target=let_go_once_queued, daemon=True).start()
        with closing(connect("psycopg2", budget_dsn)) as conn:
            budget.admit(conn)  # queues on slot 0 and gets it once the holder lets go
            assert budget.slot == 0 and [a for _, _, a in slots(db)] == [""]
            assert budget.take() == {"slots": 1000.0}
            budget.release(conn)
            assert slots(db) == []
    finally:
        holder.close()
