"""The database's pressure signals, read between batches (never inside a batch transaction), each with
its value, its threshold and what crossing it does.

The foreground's latency itself is the ledger's canary (``LedgerBudget.canary``): a one-row write
committed with ``synchronous_commit = on``, timed. It needs no extension and no privilege, and it waits on
what an application's commit waits on (the WAL flush, the CPU, the locks of the buffer it writes), which is
what a purge takes from the application. ``pg_stat_statements`` deltas of other roles would read the
application's own statements, but only where the extension is preloaded (a server restart) and visible to
this role, and only as averages over whatever ran: docs/concepts.md says more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import RetentionError, RetryableError
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)

# What a signal above its threshold does: step the budget down one step, pause every batch until it is
# back below, or nothing (recorded only).
STEP, PAUSE, RECORD = "step", "pause", "record"

_CONNECTIONS = (
    "SELECT (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'client backend')::float8,"
    " (current_setting('max_connections')::integer"
    " - current_setting('superuser_reserved_connections')::integer)::float8"
)
_LOCK_WAITERS = "SELECT count(*)::float8 FROM pg_catalog.pg_locks WHERE relation = %(t)s::regclass AND NOT granted"
# Without pg_monitor (pg_read_all_stats) a role sees the standbys' rows with NULL state and lag.
_REPLICA_LAG = (
    "SELECT coalesce(max(extract(epoch FROM replay_lag)) * 1000, 0)::float8, count(*) - count(state)"
    " FROM pg_catalog.pg_stat_replication"
)
_ARCHIVE_MODE = "SELECT current_setting('archive_mode')"
# pg_ls_archive_statusdir() needs pg_monitor: without it the signal is unreadable.
_ARCHIVE_BACKLOG = "SELECT count(*)::float8 FROM pg_catalog.pg_ls_archive_statusdir() WHERE name LIKE '%%.ready'"
# Without pg_read_all_stats another role's vacuum shows a NULL relid: not seen, so autovacuum reads 0.
_AUTOVACUUM = "SELECT count(*)::float8 FROM pg_catalog.pg_stat_progress_vacuum WHERE relid = %(t)s::regclass"
# The WAL position, the bytes written since the previous observation's, and the rate at which checkpoints
# stay timed: a checkpoint is requested once max_wal_size / (1 + checkpoint_completion_target) of WAL is
# written since the last one, so writing faster than that per checkpoint_timeout forces them back to back.
_WAL = (
    "SELECT pg_catalog.pg_current_wal_lsn()::text,"
    " pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), %(since)s::pg_lsn)::float8,"
    " pg_catalog.pg_size_bytes(current_setting('max_wal_size'))::float8"
    " / (1 + current_setting('checkpoint_completion_target')::float8)"
    " / (SELECT setting::float8 FROM pg_catalog.pg_settings WHERE name = 'checkpoint_timeout')"
)
WAL_RATE = "wal_rate"
# The lower threshold of the WAL rate, as a share of its limit: the band between is the hysteresis.
WAL_LOWER = 0.7
MB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Signal:
    """One pressure signal as read: ``value`` None when it could not be read (``error`` says why)."""

    name: str
    value: float | None
    limit: float | None
    effect: str
    unit: str = ""
    error: str | None = None
    # Below this the signal counts as quiet (None: below ``limit``); between the two the budget holds.
    lower: float | None = None
    # A cost only a foreground pays (the WAL rate's forced checkpoints): ignored while nobody else works.
    foreground_only: bool = False
    # Its value grows with the work the budget allows (the WAL rate): a step down goes straight to the
    # step that brings it under ``lower``, not one step per period.
    proportional: bool = False

    @property
    def quiet(self) -> bool:
        if self.value is None:
            return True
        bound = self.lower if self.lower is not None else self.limit
        return bound is None or self.value <= bound

    @property
    def high(self) -> bool:
        return self.value is not None and self.limit is not None and self.value > self.limit

    def describe(self) -> str:
        """``lock_waiters 3 > 0``, for logs and the ledger."""
        if self.value is None:
            return f"{self.name} unreadable ({self.error})" if self.error else f"{self.name} not measured"
        op = ">" if self.high else "<="
        limit = f" {op} {fmt(self.limit)}{self.unit}" if self.limit is not None else ""
        return f"{self.name} {fmt(self.value)}{self.unit}{limit}"

    def to_dict(self) -> dict[str, Any]:
        out = {"value": self.value, "limit": self.limit, "effect": self.effect, "error": self.error}
        if self.lower is not None:
            out["lower"] = self.lower
        return out


def fmt(value: float | None) -> str:
    """A signal's value or threshold as logs show it: ``3``, ``2.5``."""
    if value is None:
        return "?"
    if value == int(value):
        return f"{int(value)}"
    return f"{value:.2g}" if abs(value) < 1 else f"{value:.1f}"


def read_signals(conn: Any, policy: RetentionPolicy) -> list[Signal]:
    """Every signal but the canary, one short transaction each (a signal this role may not read fails alone)."""
    budget, table = policy.budget, {"t": policy.table.regclass_literal}
    signals = [
        _read(conn, policy, "connections", STEP, _connections(budget.connection_reserve)),
        _read(conn, policy, "lock_waiters", STEP, _one(_LOCK_WAITERS, table, budget.max_lock_waiters)),
        _read(conn, policy, "replica_lag", PAUSE, _replica_lag(budget.max_replica_lag_ms), unit="ms"),
        _read(conn, policy, "archive_backlog", PAUSE, _archive_backlog(budget.max_archive_backlog)),
        _read(
            conn,
            policy,
            "autovacuum",
            STEP if budget.yield_to_autovacuum else RECORD,
            _one(_AUTOVACUUM, table, 0),
        ),
    ]
    if policy.throttle.probe is not None:
        signals.append(_read(conn, policy, "probe", STEP, _one(policy.throttle.probe, None, policy.throttle.probe_max)))
    return signals


def read_wal_rate(
    conn: Any, policy: RetentionPolicy, since_lsn: str | None, elapsed_s: float | None
) -> tuple[Signal, str | None]:
    """The server's WAL rate (MB/s) since the previous observation (its position ``since_lsn``, ``elapsed_s``
    ago), against ``max_wal_rate``, and the position now. No previous observation: recorded, no value yet.

    Checkpoints forced back to back are what a purge's WAL costs the application: each one ends in fsyncs
    that stall every commit for up to hundreds of milliseconds on a small disk (docs/performance.md). A
    cost the application pays only if there is one: the controller ignores it while nobody else works.
    """
    setting = policy.budget.max_wal_rate  # None (false): recorded only
    lsn_row: list[Any] = []

    def read(cur: Any) -> tuple[float | None, float | None]:
        cur.execute(_WAL, {"since": since_lsn or "0/0"})
        lsn, written, auto = cur.fetchone()
        lsn_row.append(lsn)
        limit = None if setting is None else auto / MB if setting == "auto" else float(setting)
        if since_lsn is None or not elapsed_s or elapsed_s <= 0:
            return None, limit  # one position: a rate from the next observation on
        return max(0.0, written) / MB / elapsed_s, limit

    signal = _read(conn, policy, WAL_RATE, STEP if setting is not None else RECORD, read, unit="MB/s")
    rate = replace(
        signal,
        # Not measured yet, or unread (a standby has no WAL position of its own): recorded, never a step down.
        effect=signal.effect if signal.value is not None else RECORD,
        lower=signal.limit * WAL_LOWER if signal.limit is not None else None,
        foreground_only=True,
        proportional=True,
    )
    return rate, lsn_row[0] if lsn_row else None


def _read(conn: Any, policy: RetentionPolicy, name: str, effect: str, reader: Any, unit: str = "") -> Signal:
    try:
        with dbapi.transaction(conn, read_only=True) as cur:
            dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
            value, limit = reader(cur)
    except RetentionError as exc:
        if isinstance(exc, RetryableError) and exc.sqlstate is None:
            raise  # the connection is lost: the batch would fail too
        return Signal(name, None, None, effect, unit, error=" ".join(str(exc).split())[:200])
    return Signal(name, value, limit, effect, unit)


def _one(sql: str, params: dict[str, Any] | None, limit: float | None) -> Any:
    def read(cur: Any) -> tuple[float, float | None]:
        cur.execute(sql, params) if params is not None else cur.execute(sql)
        row = cur.fetchone()
        return (float(row[0]) if row and row[0] is not None else 0.0), limit

    return read


def _connections(reserve: int) -> Any:
    def read(cur: Any) -> tuple[float, float]:
        cur.execute(_CONNECTIONS)
        used, available = cur.fetchone()
        return float(used), max(0.0, float(available) - reserve)

    return read


def _replica_lag(limit_ms: int) -> Any:
    def read(cur: Any) -> tuple[float, float]:
        cur.execute(_REPLICA_LAG)
        lag, hidden = cur.fetchone()
        if hidden:
            raise _Unreadable(f"{hidden} standby(s) whose replay lag this role cannot see: grant it pg_monitor")
        return float(lag or 0.0), float(limit_ms)

    return read


def _archive_backlog(limit: int) -> Any:
    def read(cur: Any) -> tuple[float, float]:
        cur.execute(_ARCHIVE_MODE)
        if cur.fetchone()[0] == "off":
            return 0.0, float(limit)
        cur.execute(_ARCHIVE_BACKLOG)
        return float(cur.fetchone()[0]), float(limit)

    return read


class _Unreadable(RetentionError):
    """A signal read, but not whole (rows this role may not see)."""
