"""Statements on the ledger's budget tables: the controller's state that every worker of every purge on the
database reads (``budget_state``, one row), the claim of an observation period by one worker, the canary
it times (``budget_canary``), its observations (``budget_observations``), the batch slots and the tenant
slots (session-level advisory locks, released by PostgreSQL when a worker's session ends) and each chunk's
time paused per reason (``chunks.paused``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import RetryableError
from airflow_retention.core.ledger.schema import LedgerSchema

SCOPE = "database"
# The advisory lock space of the batch slots: (SLOT_CLASS, slot number), shared by every ledger schema of
# the database, so that purges with ledgers of their own still share the slots.
SLOT_CLASS = 0x52657442  # "RetB"
# The tenant slots' space: (TENANT_CLASS, hashtext of table, tenant and slot number). Two tenants whose
# texts hash alike share a ceiling, which only slows them.
TENANT_CLASS = 0x52657454  # "RetT"
# A session queued for a lock holds its statement's snapshot, and with it the database's xmin horizon (no
# table of the database may prune a row version younger than it), for as long as it waits: three workers
# queued a period at a time kept the horizon up to 2 s behind for the whole purge. They queue in waits of at
# most this, each its own statement: no longer than a batch at the default target_batch_time holds its own.
WAIT_SLICE_MS = 200
_STATE_COLUMNS = (
    "level, quiet, paused, concurrency, duty, baseline_ms, reasons, causes,"
    " extract(epoch FROM clock_timestamp() - observed_at)::float8"
)


@dataclass(frozen=True)
class BudgetState:
    """The budget as the last observation left it; ``age_s`` None: never observed."""

    level: int
    quiet: int
    paused: bool
    concurrency: int
    duty: float
    baseline_ms: float | None
    reasons: tuple[str, ...]
    causes: tuple[str, ...]
    age_s: float | None

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> BudgetState:
        level, quiet, paused, concurrency, duty, baseline, reasons, causes, age = row
        return cls(level, quiet, paused, concurrency, float(duty), baseline, tuple(reasons), tuple(causes), age)


@dataclass(frozen=True)
class TenantSlot:
    """One of the ``ceiling`` slots of a tenant of a table (``max_workers_per_tenant``).

    ``table`` is the table's quoted name (:attr:`~airflow_retention.core.policy.identifiers.TableName.sql`,
    resolved by the server's ``regclass``): the slot is keyed by the table's OID, so that two policies that
    spell one table differently (``events``, ``public.events``) share its tenants' ceiling. Empty for
    :data:`PURGE_MARK`, which is keyed by its text alone.
    """

    table: str
    tenant: str
    number: int

    @property
    def key(self) -> str:
        """The slot's key after the table's: hashed with the table's OID by the server."""
        return f"{self.tenant}\x1f{self.number}"


# A batch slot (its number) or a tenant slot.
Slot = int | TenantSlot
# Held (shared, so by any number of sessions at once) by every session a chunk task works in, from its first
# statement: the purges' own sessions, even before they take a slot (waiting for the first baseline), are
# not a foreground to yield to. In the tenant slots' key space, under a key no tenant slot has.
PURGE_MARK = TenantSlot("", "", -1)


# The advisory locks of this database keyed by two integers (the slots' and the purge mark's), for pg_locks.
_SLOT_LOCKS = (
    " FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
    " AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
)


def _tenant_key(key: str, table: str) -> str:
    """The SQL of a tenant slot's second lock key: the server's hash of ``key`` (an SQL text expression)
    after the OID of the table in parameter ``%(table)s`` (none for :data:`PURGE_MARK`)."""
    return f"hashtext(concat(%(table)s::regclass::oid, chr(31), {key}))" if table else f"hashtext({key})"


def _lock_args(slot: Slot) -> tuple[str, dict[str, Any]]:
    """The advisory lock's two keys of ``slot``: SQL and parameters (the tenant's text hashed by the server)."""
    if isinstance(slot, TenantSlot):
        params = {"k": TENANT_CLASS, "slot": slot.key, "table": slot.table}
        return f"%(k)s::integer, {_tenant_key('%(slot)s::text', slot.table)}", params
    return "%(k)s::integer, %(slot)s::integer", {"k": SLOT_CLASS, "slot": slot}


class LedgerBudget(LedgerSchema):
    """The database budget's shared state."""

    def budget_state(
        self, conn: Any, *, level: int, concurrency: int, duty: float, period_s: float
    ) -> tuple[BudgetState, bool]:
        """The budget's state, created at ``level`` if there is none; and whether this caller claimed the
        observation that is due (the last one is ``period_s`` old and nobody else is making it)."""
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"INSERT INTO {self.s}.budget_state (scope, level, concurrency, duty)"
                " VALUES (%(scope)s, %(level)s::integer, %(c)s::integer, %(duty)s::float8)"
                " ON CONFLICT (scope) DO NOTHING",
                {"scope": SCOPE, "level": level, "c": concurrency, "duty": duty},
            )
            cur.execute(
                f"UPDATE {self.s}.budget_state"
                " SET claimed_until = clock_timestamp() + make_interval(secs => %(p)s::float8)"
                " WHERE scope = %(scope)s"
                " AND coalesce(observed_at, '-infinity') <= clock_timestamp() - make_interval(secs => %(p)s::float8)"
                " AND coalesce(claimed_until, '-infinity') <= clock_timestamp()"
                f" RETURNING {_STATE_COLUMNS}",
                {"scope": SCOPE, "p": period_s},
            )
            row = cur.fetchone()
            if row is not None:
                return BudgetState.of(row), True
            cur.execute(f"SELECT {_STATE_COLUMNS} FROM {self.s}.budget_state WHERE scope = %(scope)s", {"scope": SCOPE})
            return BudgetState.of(cur.fetchone()), False

    def canary(self, conn: Any) -> float:
        """One canary: a one-row write committed with ``synchronous_commit = on``, in milliseconds."""
        started = time.perf_counter()
        with dbapi.transaction(conn) as cur:
            cur.execute("SET LOCAL synchronous_commit = on")
            cur.execute(
                f"INSERT INTO {self.s}.budget_canary (scope, at) VALUES (%(scope)s, clock_timestamp())"
                " ON CONFLICT (scope) DO UPDATE SET at = EXCLUDED.at",
                {"scope": SCOPE},
            )
        return (time.perf_counter() - started) * 1000

    def canary_median(self, conn: Any, periods: int) -> tuple[float | None, int]:
        """The median canary of the last ``periods`` observations since the baseline was measured, and how
        many there were (fewer early in a run)."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY canary_ms), count(*) FROM"
            f" (SELECT o.canary_ms FROM {self.s}.budget_observations o JOIN {self.s}.budget_state s USING (scope)"
            " WHERE o.scope = %(scope)s AND o.at > s.baseline_at AND o.canary_ms IS NOT NULL"
            " ORDER BY o.at DESC LIMIT %(n)s::integer) recent",
            {"scope": SCOPE, "n": periods},
        )
        median, count = rows[0]
        return (None if median is None else float(median)), int(count)

    def wal_mark(self, conn: Any, window_s: float) -> tuple[str, float] | None:
        """Where the WAL rate is measured from: the WAL position and age (seconds) of the newest observation
        at least ``window_s`` old, else of the oldest younger one; observations older than three windows
        belong to purges that ended. None: no observation in that span."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT signals -> 'wal_rate' ->> 'lsn', extract(epoch FROM clock_timestamp() - at)::float8"
            f" FROM {self.s}.budget_observations WHERE scope = %(scope)s"
            " AND at >= clock_timestamp() - make_interval(secs => 3 * %(w)s::float8)"
            " AND signals -> 'wal_rate' ->> 'lsn' IS NOT NULL ORDER BY at",
            {"scope": SCOPE, "w": window_s},
        )
        if not rows:
            return None
        old = [r for r in rows if r[1] >= window_s]
        lsn, age = old[-1] if old else rows[0]
        return lsn, float(age)

    def slots(self, conn: Any) -> tuple[int, int]:
        """Batch slots held, and sessions queued for one (``wait_slot``)."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted){_SLOT_LOCKS}"
            " AND classid = %(k)s::bigint::oid",
            {"k": SLOT_CLASS},
        )
        return int(rows[0][0]), int(rows[0][1])

    def slot_holders(self, conn: Any, among: Sequence[TenantSlot] = ()) -> frozenset[tuple[Any, ...]]:
        """Every batch and tenant slot other sessions hold on this database, with what its session last did:
        (backend pid, lock class, key, the session's last statement start and state change). Read before and
        after a wait for a slot: the same set at both ends means no batch began or ended meanwhile, not even
        one by a session that gave a slot back and took it again (its statements moved the times). Another
        role's times are hidden without ``pg_read_all_stats``: then only the slots themselves are compared.

        :param among: only these slots (one tenant's of one table): a wait for a tenant's slot is held up by
            that tenant's batches alone, whatever the other tenants' do."""
        sql = (
            "SELECT l.pid, l.classid::bigint, l.objid::bigint, a.query_start, a.state_change FROM ("
            f"SELECT pid, classid, objid{_SLOT_LOCKS} AND granted AND mode = 'ExclusiveLock'"
            " AND pid <> pg_backend_pid()"
        )
        params: dict[str, Any] = {"k": SLOT_CLASS, "t": TENANT_CLASS}
        if among:
            (table,) = {slot.table for slot in among}
            # An int4 key cast to oid is the lock's objid.
            sql += (
                f" AND classid = %(t)s::bigint::oid AND objid IN (SELECT {_tenant_key('s', table)}::oid"
                " FROM unnest(%(keys)s::text[]) AS s)"
            )
            params.update(table=table, keys=[slot.key for slot in among])
        else:
            sql += " AND classid IN (%(k)s::bigint::oid, %(t)s::bigint::oid)"
        sql += ") l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        rows = dbapi.fetch_all(conn, sql, params)
        return frozenset((int(pid), int(cls), int(key), started, changed) for pid, cls, key, started, changed in rows)

    def foreground_sessions(self, conn: Any, within_s: float, ignore_databases: Sequence[str] = ()) -> int:
        """Client sessions of the server, other than this one and the purges' (holding :data:`PURGE_MARK`,
        or holding or queued for a batch or tenant slot) and those in ``ignore_databases``, that ran a
        statement in the last ``within_s`` seconds: someone for the budget to yield to. A session whose
        state this role may not see counts (it may be busy)."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT count(*) FROM pg_catalog.pg_stat_activity a"
            " WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()"
            " AND coalesce(a.datname, '') <> ALL (%(ignore)s::text[])"
            " AND (a.state IS NULL OR a.state <> 'idle'"
            " OR a.state_change > clock_timestamp() - make_interval(secs => %(s)s::float8))"
            " AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory'"
            " AND l.classid IN (%(k)s::bigint::oid, %(t)s::bigint::oid) AND l.objsubid = 2)",
            {"s": within_s, "k": SLOT_CLASS, "t": TENANT_CLASS, "ignore": list(ignore_databases)},
        )
        return int(rows[0][0])

    def record_observation(
        self,
        conn: Any,
        *,
        level: int,
        quiet: int,
        paused: bool,
        concurrency: int,
        duty: float,
        move: str,
        canary_ms: float | None,
        baseline_ms: float,
        new_baseline: bool,
        slots_busy: int | None,
        signals: Mapping[str, Any],
        reasons: tuple[str, ...],
        causes: tuple[str, ...] | None,
        observer: str,
    ) -> None:
        """The decision of the claimed period, for every worker; ``causes`` None keeps the ones recorded."""
        params = {
            "scope": SCOPE,
            "level": level,
            "quiet": quiet,
            "paused": paused,
            "c": concurrency,
            "duty": duty,
            "move": move,
            "canary": canary_ms,
            "baseline": baseline_ms,
            "new_baseline": new_baseline,
            "busy": slots_busy,
            "signals": json.dumps(signals),
            "reasons": list(reasons),
            "causes": list(causes) if causes is not None else None,
            "observer": observer,
        }
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"UPDATE {self.s}.budget_state SET level = %(level)s::integer, quiet = %(quiet)s::integer,"
                " paused = %(paused)s::boolean, concurrency = %(c)s::integer, duty = %(duty)s::float8,"
                " canary_ms = %(canary)s::float8, reasons = %(reasons)s::text[],"
                " causes = coalesce(%(causes)s::text[], causes), signals = %(signals)s::jsonb,"
                " baseline_ms = %(baseline)s::float8,"
                " baseline_at = CASE WHEN %(new_baseline)s::boolean THEN clock_timestamp() ELSE baseline_at END,"
                " observed_at = clock_timestamp(), claimed_until = NULL, observer = %(observer)s::text"
                " WHERE scope = %(scope)s",
                params,
            )
            cur.execute(
                f"INSERT INTO {self.s}.budget_observations (scope, level, concurrency, duty, paused, move,"
                " canary_ms, baseline_ms, slots_busy, signals, reasons, observer)"
                " VALUES (%(scope)s, %(level)s::integer, %(c)s::integer, %(duty)s::float8, %(paused)s::boolean,"
                " %(move)s::text, %(canary)s::float8, %(baseline)s::float8, %(busy)s::integer,"
                " %(signals)s::jsonb, %(reasons)s::text[], %(observer)s::text)",
                params,
            )

    def try_slot(self, conn: Any, slot: Slot) -> bool:
        args, params = _lock_args(slot)
        return bool(dbapi.fetch_all(conn, f"SELECT pg_try_advisory_lock({args})", params)[0][0])

    def wait_slot(self, conn: Any, slot: Slot, timeout_ms: int) -> bool:
        """Queue for ``slot`` behind its holder (PostgreSQL grants it in turn), at most ``timeout_ms``: in
        waits of at most :data:`WAIT_SLICE_MS`, each its own statement, so that no waiter holds a snapshot
        longer than that."""
        args, params = _lock_args(slot)
        deadline = time.monotonic() + max(1, timeout_ms) / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                with dbapi.transaction(conn) as cur:
                    cur.execute(
                        "SELECT set_config('lock_timeout', %(t)s, true)",
                        {"t": str(max(1, min(WAIT_SLICE_MS, left_ms)))},
                    )
                    cur.execute(f"SELECT pg_advisory_lock({args})", params)
            except RetryableError as exc:
                if exc.sqlstate != "55P03":
                    raise
                if left_ms <= WAIT_SLICE_MS:
                    return False
                continue
            return True

    def touch(self, conn: Any) -> None:
        """One empty statement: it moves this session's ``query_start`` in ``pg_stat_activity``, which a
        worker waiting for a slot this session holds reads as "not hung" (:meth:`slot_holders`)."""
        dbapi.fetch_all(conn, "SELECT 1")

    def release_slot(self, conn: Any, slot: Slot) -> None:
        args, params = _lock_args(slot)
        dbapi.fetch_all(conn, f"SELECT pg_advisory_unlock({args})", params)

    def mark(self, conn: Any, held: bool) -> None:
        """Take (``held``) or give back :data:`PURGE_MARK` for this session."""
        args, params = _lock_args(PURGE_MARK)
        function = "pg_advisory_lock_shared" if held else "pg_advisory_unlock_shared"
        dbapi.fetch_all(conn, f"SELECT {function}({args})", params)

    def observations(self, conn: Any, since: Any, until: Any | None = None) -> list[dict[str, Any]]:
        """The budget's observations from ``since`` (to ``until``), oldest first: a run's chart."""
        rows = dbapi.fetch_all(
            conn,
            f"SELECT at, level, concurrency, duty, paused, move, canary_ms, baseline_ms, slots_busy, signals, reasons"
            f" FROM {self.s}.budget_observations WHERE at >= %(since)s::timestamptz"
            " AND (%(until)s::timestamptz IS NULL OR at <= %(until)s::timestamptz) ORDER BY at",
            {"since": since, "until": until},
        )
        keys = ("at", "level", "concurrency", "duty", "paused", "move", "canary_ms", "baseline_ms", "slots_busy",
                "signals", "reasons")  # fmt: skip
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def forget_observations(self, conn: Any, keep_days: int) -> int:
        """Delete the budget's observations older than ``keep_days`` (every planner does, with its policy's
        ``ledger_keep_days``: the database's observations are kept as long as its shortest-lived runs)."""
        with dbapi.transaction(conn) as cur:
            cur.execute(
                f"DELETE FROM {self.s}.budget_observations WHERE at < now() - make_interval(days => %(d)s::integer)",
                {"d": keep_days},
            )
            return int(cur.rowcount)
