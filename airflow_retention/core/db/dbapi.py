"""The little the core needs from a DB-API connection, the same on psycopg2 and psycopg 3.

Statements use ``%(name)s`` placeholders (both drivers accept them) and cast every parameter
explicitly (``::bigint``, ``::timestamptz``), because psycopg 3 types a Python int by its value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from airflow_retention.core.errors import PermanentError, RetryableError

# SQLSTATEs a retry can fix: timeouts, lost sessions, deadlocks, serialization failures, shortage.
_RETRYABLE_STATES = {"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "55006"}
_RETRYABLE_CLASSES = {"08", "53", "58"}
_PERMANENT_CLASSES = {"0A", "22", "23", "28", "2B", "3D", "3F", "42", "44", "P0"}
# A write refused by a read-only transaction (a dry run's statement that would have written): a retry
# would be refused again.
READ_ONLY_VIOLATION = "25006"
_PERMANENT_STATES = {READ_ONLY_VIOLATION}


def driver_name(conn: Any) -> str:
    """``"psycopg"`` (3) or ``"psycopg2"``."""
    return "psycopg" if type(conn).__module__.split(".")[0] == "psycopg" else "psycopg2"


def cursor(conn: Any) -> Any:
    """A cursor returning plain tuples, whatever row factory the connection was configured with."""
    if driver_name(conn) == "psycopg":
        from psycopg.rows import tuple_row

        return conn.cursor(row_factory=tuple_row)
    import psycopg2.extensions

    return conn.cursor(cursor_factory=psycopg2.extensions.cursor)


def prepare(conn: Any) -> None:
    """Put the connection in explicit-transaction mode: every batch is committed by us, once."""
    if getattr(conn, "autocommit", False):
        conn.rollback()
        conn.autocommit = False


@contextmanager
def transaction(conn: Any, *, repeatable_read: bool = False, read_only: bool = False) -> Iterator[Any]:
    """One top-level transaction: commit on success, roll back on any error, and translate errors.

    Deliberately not psycopg 3's ``conn.transaction()``, which is only a savepoint on a connection
    that is not in autocommit mode.

    :param repeatable_read: every statement of the transaction sees one snapshot; a row that someone
        else changed since fails a write with a serialization error (SQLSTATE 40001).
    :param read_only: the whole transaction is ``READ ONLY`` from its first statement: any write in it
        fails (SQLSTATE 25006). A transaction that must also write (a dry-run batch records its counts
        in the ledger) uses :func:`read_only` around its reads instead.
    """
    cur = cursor(conn)
    try:
        if repeatable_read or read_only:
            cur.execute(
                "SET TRANSACTION"
                + (" ISOLATION LEVEL REPEATABLE READ" if repeatable_read else "")
                + (" READ ONLY" if read_only else "")
            )
        yield cur
        conn.commit()
    except BaseException as exc:
        _rollback_quietly(conn)
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc
    finally:
        _close_quietly(cur)


_READ_ONLY_SAVEPOINT = "retention_read_only"


def begin_read_only(cur: Any) -> None:
    """From here on the current transaction is read-only, until :func:`end_read_only`: every statement
    that would write (a ``DELETE``, an ``INSERT`` into an archive) fails with SQLSTATE 25006 instead.

    Why a savepoint and not a ``READ ONLY`` transaction: a dry-run batch counts the rows of the target
    and records the counts in the ledger in one transaction, under the lock of the chunk's ledger row
    (attempts of a chunk queue there, and a count is recorded exactly once). PostgreSQL lets a
    transaction turn read-only at any point (``SET TRANSACTION READ ONLY`` after its first statement),
    never back; but the setting is undone with the savepoint it was made in, so the ledger writes after
    :func:`end_read_only` go through while the statements between cannot write at all."""
    cur.execute(f"SAVEPOINT {_READ_ONLY_SAVEPOINT}")
    cur.execute("SET TRANSACTION READ ONLY")


def end_read_only(cur: Any) -> None:
    """Undo :func:`begin_read_only` (roll back to its savepoint: read-write again, and nothing the reads
    did is kept). On a cursor of its own, so that ``cur`` keeps the rows of its last statement."""
    guard = cursor(cur.connection)
    try:
        guard.execute(f"ROLLBACK TO SAVEPOINT {_READ_ONLY_SAVEPOINT}")
        guard.execute(f"RELEASE SAVEPOINT {_READ_ONLY_SAVEPOINT}")
    finally:
        _close_quietly(guard)


@contextmanager
def read_only(cur: Any, enabled: bool = True) -> Iterator[Any]:
    """The statements of the block run read-only (:func:`begin_read_only`); nothing when not ``enabled``.
    An error leaves the transaction to its caller, who rolls it back."""
    if not enabled:
        yield cur
        return
    begin_read_only(cur)
    yield cur
    end_read_only(cur)


def set_local_timeouts(
    cur: Any,
    lock_timeout_ms: int,
    statement_timeout_ms: int,
    *,
    wal_compression: str | None = None,
    synchronous_commit: str | None = None,
) -> None:
    """``lock_timeout`` and ``statement_timeout`` (and ``wal_compression``, ``synchronous_commit`` when
    given) for the rest of the current transaction only, in one round trip."""
    params = {
        "lock": str(lock_timeout_ms),
        "statement": str(statement_timeout_ms),
        "wal": wal_compression,
        "sync": synchronous_commit,
    }
    cur.execute(
        "SELECT set_config('lock_timeout', %(lock)s, true), set_config('statement_timeout', %(statement)s, true)"
        + (", set_config('wal_compression', %(wal)s, true)" if wal_compression is not None else "")
        + (", set_config('synchronous_commit', %(sync)s, true)" if synchronous_commit is not None else ""),
        params,
    )


def durable_commit(cur: Any) -> None:
    """The current transaction commits with the session's own ``synchronous_commit`` (from the server's
    configuration, ``ALTER ROLE``/``DATABASE … SET`` or the connection's options; a plain session
    ``SET`` is not kept), not the ``off`` a batch set: the commit that records a chunk complete."""
    cur.execute("SET LOCAL synchronous_commit TO DEFAULT")


def outside_transaction(conn: Any, statement: str, settings: Mapping[str, str] | None = None) -> None:
    """Run a statement that cannot run inside a transaction block (``VACUUM``, ``DETACH PARTITION …
    CONCURRENTLY``) in autocommit mode, with session ``settings`` (GUC name → value) for its duration
    only; errors are translated like any other."""
    prepare(conn)
    conn.autocommit = True
    cur = cursor(conn)
    try:
        for name, value in (settings or {}).items():
            cur.execute("SELECT set_config(%(n)s, %(v)s, false)", {"n": name, "v": value})
        cur.execute(statement)
    except Exception as exc:
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc
    finally:
        try:
            for name in settings or {}:
                cur.execute("SELECT set_config(%(n)s, NULL, false)", {"n": name})
        except Exception:  # noqa: BLE001 - the connection may be gone; the original error matters more
            pass
        _close_quietly(cur)
        try:
            conn.autocommit = False
        except Exception:  # noqa: BLE001
            pass


def fetch_all(
    conn: Any, sql: str, params: Mapping[str, Any] | None = None, *, lock_timeout_ms: int | None = None
) -> list[tuple[Any, ...]]:
    """Run one read-only statement in its own transaction and return its rows. With ``lock_timeout_ms``
    the statement waits at most that long for a table lock (behind a queued ``ALTER TABLE``, say) and
    fails retryable (55P03) instead of joining the lock queue for good."""
    with transaction(conn) as cur:
        if lock_timeout_ms is not None:
            cur.execute("SELECT set_config('lock_timeout', %(lock)s, true)", {"lock": str(lock_timeout_ms)})
        cur.execute(sql, params)
        return list(cur.fetchall())


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (psycopg 3 ``sqlstate``, psycopg2 ``pgcode``)."""
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)


def is_driver_error(exc: BaseException) -> bool:
    return any(cls.__module__.split(".")[0] in ("psycopg", "psycopg2") for cls in type(exc).__mro__)


def translate(exc: BaseException) -> BaseException:
    """Map a driver error to :class:`RetryableError` or :class:`PermanentError`; leave others alone."""
    if not is_driver_error(exc):
        return exc
    state = sqlstate(exc)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if state in _PERMANENT_STATES:
        return PermanentError(f"{_describe(state)}: {message}")
    if state is None or state in _RETRYABLE_STATES or state[:2] in _RETRYABLE_CLASSES:
        # No SQLSTATE means the driver lost the connection (server restart, network, killed session).
        return RetryableError(f"{_describe(state)}: {message}", state)
    if state[:2] in _PERMANENT_CLASSES:
        return PermanentError(f"{_describe(state)}: {message}")
    return RetryableError(f"{_describe(state)}: {message}", state)


_NAMES = {
    "55P03": "lock timeout",
    "57014": "statement timeout or cancel",
    "40P01": "deadlock",
    "40001": "serialization failure",
    "57P01": "session terminated by the administrator",
    "42501": "insufficient privilege",
    "42P01": "undefined table",
    "42703": "undefined column",
    "42601": "syntax error",
    READ_ONLY_VIOLATION: "write in a read-only transaction (a dry run never writes)",
}


def _describe(state: str | None) -> str:
    if state is None:
        return "connection lost"
    return f"{_NAMES.get(state, 'database error')} (SQLSTATE {state})"


def _rollback_quietly(conn: Any) -> None:
    try:
        conn.rollback()
    except Exception:  # noqa: BLE001 - the connection may be gone; the original error matters more
        pass


def _close_quietly(cur: Any) -> None:
    try:
        cur.close()
    except Exception:  # noqa: BLE001
        pass
