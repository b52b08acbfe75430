"""Failures isolated per tenant: one tenant's rows that cannot be deleted do not strand the others.

A batch of a key chunk that packs tenants deletes one tenant's rows, under a savepoint: when it fails
for a reason a retry cannot fix, the tenant is recorded and the chunk goes on with its next tenant.
A one-pass batch runs under a savepoint. When it fails for a reason a retry cannot fix (a foreign key
that still references a row, a missing privilege, a constraint of the archive table), it is rolled back
to the savepoint and run again one tenant at a time, each under a savepoint of its own: the tenants
whose rows go through are deleted and counted in the same transaction, the ones that fail are
returned with their failure, for the engine to record as dead letters and to leave out of the chunk's
later batches. Transient failures (lock and statement timeouts, lost sessions) are not isolated: the
whole batch rolls back and the task's retry resumes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.sql.batches import TenantBatch

# What users hit, in words; the rest is named by its SQLSTATE class.
_CLASSES = {
    "23503": "foreign key violation",
    "23505": "unique violation",
    "23502": "not-null violation",
    "23514": "check violation",
    "42501": "insufficient privilege",
    "P0001": "raised by a trigger",
}
_REFERENCING = re.compile(r'foreign key constraint "(?P<constraint>[^"]+)" on table "(?P<table>[^"]+)"')


@dataclass(frozen=True)
class TenantFailure:
    tenant: str
    failure_class: str
    sqlstate: str | None
    message: str


def describe(exc: BaseException) -> tuple[str, str | None, str]:
    """The failure class in words, the SQLSTATE and a message that names what users need: the table
    whose foreign key holds the rows, or the privilege the statement needed."""
    state = dbapi.sqlstate(exc)
    message = " ".join(str(exc).split())
    failure = _CLASSES.get(state or "", f"database error {state}" if state else "database error")
    if state == "23503" and (found := _REFERENCING.search(message)):
        failure = f"foreign key violation: rows of table {found['table']} still reference them"
    elif state == "42501":
        failure = "insufficient privilege: " + message.split(":", 1)[-1].strip()
    return failure, state, message


def is_permanent(exc: BaseException) -> bool:
    """Whether a failure is one of the rows (isolated per tenant), not transient. A write refused by a dry
    run's read-only transaction is the engine's own mistake, no tenant's: it fails the chunk as it is."""
    if dbapi.sqlstate(exc) == dbapi.READ_ONLY_VIOLATION:
        return False
    return dbapi.is_driver_error(exc) and isinstance(dbapi.translate(exc), PermanentError)


def run_isolated(
    cur: Any, passes: TenantBatch, params: dict[str, Any], tenants_statement: str, only: list[str] | None = None
) -> tuple[list[tuple[Any, ...]], list[TenantFailure]]:
    """Run a one-pass batch statement (of the ``only`` tenants, all when None); if it fails permanently,
    run it again per tenant. Returns the per-tenant rows of what went through, and the tenants that
    failed. Raises what is not a permanent failure."""
    # A deferred foreign key would only fail at COMMIT, past every savepoint: check them per statement.
    cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    cur.execute("SAVEPOINT retention_batch")
    try:
        rows = _run(cur, passes, {**params, "only": only})
        cur.execute("RELEASE SAVEPOINT retention_batch")
        return rows, []
    except Exception as exc:
        if not is_permanent(exc):
            raise
        cur.execute("ROLLBACK TO SAVEPOINT retention_batch")
    if only is not None:
        # The statements compare tenants as the column does: each of ``only`` takes every spelling of its
        # tenant ('acme' and 'ACME' of a citext column), and a failure is recorded under the given one.
        tenants = list(only)
    else:
        cur.execute(tenants_statement, params)
        tenants = [r[0] for r in cur.fetchall()]
    rows, failures = [], []
    for tenant in tenants:
        cur.execute("SAVEPOINT retention_tenant")
        try:
            rows.extend(_run(cur, passes, {**params, "only": [tenant]}))
            cur.execute("RELEASE SAVEPOINT retention_tenant")
        except Exception as exc:
            if not is_permanent(exc):
                raise
            cur.execute("ROLLBACK TO SAVEPOINT retention_tenant")
            failures.append(TenantFailure(tenant, *describe(exc)))
    return rows, failures


def _run(cur: Any, passes: TenantBatch, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    cur.execute(passes.count, params)
    rows = list(cur.fetchall())
    if passes.delete is not None:
        cur.execute(passes.delete, params)
        counted = sum(int(r[1]) for r in rows)
        if cur.rowcount != counted:
            # Cannot happen under the batch's one snapshot; if it does, nothing of the batch is kept.
            raise RetryableError(f"one-pass batch deleted {cur.rowcount} rows where it counted {counted}")
    return rows


def run_for_tenant(
    cur: Any, statement: str, params: dict[str, Any], tenant: str, *, returns_counts: bool
) -> tuple[tuple[int, int, int], TenantFailure | None]:
    """Run one tenant's batch of a key chunk (a plain ``DELETE``, or a statement returning deleted,
    archived and matched) under a savepoint. Returns its counts, or zeros and the tenant's failure when
    it failed permanently. Raises what is not a permanent failure."""
    cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
    cur.execute("SAVEPOINT retention_tenant")
    try:
        cur.execute(statement, params)
        counts = tuple(int(n) for n in cur.fetchone()) if returns_counts else (cur.rowcount, 0, 0)
        cur.execute("RELEASE SAVEPOINT retention_tenant")
        return (counts[0], counts[1], counts[2]), None
    except Exception as exc:
        if not is_permanent(exc):
            raise
        cur.execute("ROLLBACK TO SAVEPOINT retention_tenant")
        return (0, 0, 0), TenantFailure(tenant, *describe(exc))
