"""Table builders and inspection queries for the core tests. Everything runs on the real PostgreSQL.

Tables are built in one ``INSERT ... SELECT FROM generate_series`` each; the expressions that shape
the data (tenant, timestamp, status) are SQL over the series value ``g`` and the parameter
``%(cutoff)s``, so a test states its data set in a line and the database computes the expected sets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from airflow_retention.core.policy.budget import Budget
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.controller import floor_level

# A fixed instant in the past: plan_run refuses cutoffs in the future, and a fixed one keeps run keys stable.
CUTOFF = datetime(2024, 6, 1, 12, 0, tzinfo=timezone.utc)
CONDITION = "status <> 'open'"
# The default budget's floor, its level on the ladder and its duty cycle: observations seeded "at the floor".
FLOOR_LEVEL, FLOOR_DUTY = floor_level(Budget()), Budget().min_duty
# An eligible row, as the tests compute it independently of the package's SQL.
ELIGIBLE = "created_at < %(cutoff)s::timestamptz AND status <> 'open'"

# Default data shape: 60 % of the rows before the cutoff (hours -60..-1), one in a hundred exactly at it,
# the rest after; every 7th row 'open' (held back by the condition).
CREATED_DEFAULT = "%(cutoff)s::timestamptz + (mod(g * 37, 100) - 60) * interval '1 hour'"
STATUS_DEFAULT = "CASE WHEN mod(g, 7) = 0 THEN 'open' ELSE 'closed' END"


def start_and_join(threads: list[threading.Thread], timeout: float = 120) -> None:
    """Start every thread, then wait for each."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def rows(admin: Any, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on the autocommit admin connection; return its rows (none for DDL/DML)."""
    with admin.cursor() as cur:
        cur.execute(sql, dict(params or {}))
        return list(cur.fetchall()) if cur.description is not None else []


def scalar(admin: Any, sql: str, params: Mapping[str, Any] | None = None) -> Any:
    result = rows(admin, sql, params)
    assert len(result) == 1, f"expected one row from {sql!r}, got {len(result)}"
    return result[0][0]


def create_events(
    admin: Any,
    schema: str,
    table: str = "events",
    *,
    key_type: str = "bigint",
    ts_type: str = "timestamptz",
    tenant_type: str = "integer",
    key_index: str = "primary",
    ts_index: bool = True,
    tenant_index: bool = True,
) -> str:
    """Create ``schema.table`` (id, tenant_id, created_at, status, payload); return its quoted name.

    ``key_index``: "primary" (primary key), "unique" (unique index), "plain" (non-unique index),
    "partial" (unique but partial), "composite" (unique on (id, tenant_id)) or "none".
    """
    name = f'"{schema}"."{table}"'
    rows(
        admin,
        f"CREATE TABLE {name} (id {key_type} NOT NULL, tenant_id {tenant_type}, created_at {ts_type} NOT NULL,"
        " status text NOT NULL, payload text)",
    )
    index = {
        "primary": f"ALTER TABLE {name} ADD PRIMARY KEY (id)",
        "unique": f"CREATE UNIQUE INDEX ON {name} (id)",
        "plain": f"CREATE INDEX ON {name} (id)",
        "partial": f"CREATE UNIQUE INDEX ON {name} (id) WHERE status <> 'open'",
        "composite": f"CREATE UNIQUE INDEX ON {name} (id, tenant_id)",
        "none": None,
    }[key_index]
    if index:
        rows(admin, index)
    if ts_index:
        rows(admin, f"CREATE INDEX ON {name} (created_at)")
    if tenant_index:
        rows(admin, f"CREATE INDEX ON {name} (tenant_id, id)")
    return name


def fill_events(
    admin: Any,
    table_sql: str,
    count: int,
    *,
    first_id: int = 1,
    cutoff: datetime = CUTOFF,
    tenant: str = "1",
    created: str = CREATED_DEFAULT,
    status: str = STATUS_DEFAULT,
) -> None:
    """Insert ``count`` rows with ids ``first_id..`` in one statement, then ANALYZE."""
    rows(
        admin,
        f"INSERT INTO {table_sql} (id, tenant_id, created_at, status, payload)"
        f" SELECT g, {tenant}, {created}, {status}, md5(g::text)"
        " FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g",
        {"first": first_id, "last": first_id + count - 1, "cutoff": cutoff},
    )
    rows(admin, f"ANALYZE {table_sql}")


def policy_data(schema: str, **overrides: Any) -> dict[str, Any]:
    """The YAML form of a policy on ``schema.events`` with its ledger in ``<schema>_ledger``."""
    data: dict[str, Any] = {
        "name": "events_purge",
        "conn_id": "retention_target",
        "table": f"{schema}.events",
        "key_column": "id",
        "chunk_by": "key",  # the engine's key-range path; block and partition tests override it
        "timestamp_column": "created_at",
        "retention": "30 days",
        "condition": CONDITION,
        "batch_size": 100,
        "target_batch_time": 0,  # fixed batches: tests count them (tests/core/running/test_pacing.py adapts)
        "chunk_rows": 100_000,
        "lock_timeout": "5s",
        "statement_timeout": "60s",
        "ledger_schema": f"{schema}_ledger",
        # The database budget steers by the canary's latency, which a loaded test machine moves at random: the
        # engine's tests count batches and sleeps, so it is off here; its own tests (test_budget.py, test_slo.py)
        # and the Airflow-level tests run it as the defaults have it, on.
        "budget": False,
    }
    data.update(overrides)
    return data


def make_policy(schema: str, **overrides: Any) -> RetentionPolicy:
    """A policy on ``schema.events`` with its ledger in ``<schema>_ledger``, built as YAML would be."""
    return RetentionPolicy.from_dict(policy_data(schema, **overrides))


def ids(admin: Any, table_sql: str, where: str = "true", params: Mapping[str, Any] | None = None) -> set[int]:
    return {
        r[0] for r in rows(admin, f"SELECT id FROM {table_sql} WHERE {where}", {"cutoff": CUTOFF, **(params or {})})
    }


def eligible_ids(admin: Any, table_sql: str, cutoff: datetime = CUTOFF, extra: str = "true") -> list[int]:
    """Ids eligible at ``cutoff`` under :data:`CONDITION`, sorted, computed by the tests' own SQL."""
    return [
        r[0]
        for r in rows(
            admin, f"SELECT id FROM {table_sql} WHERE {ELIGIBLE} AND ({extra}) ORDER BY id", {"cutoff": cutoff}
        )
    ]


@dataclass(frozen=True)
class ExpectedBatch:
    """One batch as the engine must cut it: ``keys`` are the next ``n`` keys of the range (of ``tenant``),
    eligible or not; ``eligible`` the ones it deletes; ``lo``/``hi`` what its report says."""

    tenant: str | None
    lo: int
    hi: int
    keys: tuple[int, ...]
    eligible: tuple[int, ...]


def expected_batches(
    admin: Any,
    table_sql: str,
    lo: int,
    hi: int,
    n: int,
    *,
    tenants: Sequence[str] | None = None,
    cutoff: datetime = CUTOFF,
    tenant_column: str = "tenant_id",
) -> list[ExpectedBatch]:
    """The batches of a chunk [lo, hi) at a fixed batch size ``n``, computed with the tests' own SQL and
    a plain loop: all keys of the range (one tenant at a time when ``tenants`` is given) in order, cut
    into groups of ``n``; a group of ``n`` keys ending before ``hi - 1`` is followed by another batch
    (possibly empty), a shorter group ends the tenant. Call it before the purge changes the table."""
    batches: list[ExpectedBatch] = []
    for tenant in tenants if tenants is not None else [None]:
        where = "id >= %(lo)s AND id < %(hi)s"
        if tenant is not None:
            where += f' AND "{tenant_column}"::text = %(t)s'
        found = rows(
            admin,
            f"SELECT id, coalesce({ELIGIBLE}, false) FROM {table_sql} WHERE {where} ORDER BY id",
            {"lo": lo, "hi": hi, "t": tenant, "cutoff": cutoff},
        )
        start = 0
        next_key = lo
        while True:
            group = found[start : start + n]
            full = len(group) == n and group[-1][0] + 1 < hi
            end = group[-1][0] + 1 if full else hi
            batches.append(
                ExpectedBatch(
                    tenant=tenant,
                    lo=next_key,
                    hi=end,
                    keys=tuple(k for k, _ in group),
                    eligible=tuple(k for k, e in group if e),
                )
            )
            if not full:
                break
            start += n
            next_key = end
    return batches


def ledger_chunks(admin: Any, ledger_schema: str, run_key: str) -> list[dict[str, Any]]:
    """The ledger's chunk rows of a run, read with the tests' own SQL, ordered by seq."""
    with admin.cursor() as cur:
        cur.execute(
            f'SELECT * FROM "{ledger_schema}".chunks WHERE run_key = %(k)s ORDER BY seq NULLS LAST, chunk_key',
            {"k": run_key},
        )
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def ledger_chunk(admin: Any, ledger_schema: str, run_key: str, chunk_key: str) -> dict[str, Any]:
    found = [c for c in ledger_chunks(admin, ledger_schema, run_key) if c["chunk_key"] == chunk_key]
    assert len(found) == 1, f"chunk {chunk_key} of {run_key}: {len(found)} ledger rows"
    return found[0]


def ledger_run(admin: Any, ledger_schema: str, run_key: str) -> dict[str, Any] | None:
    with admin.cursor() as cur:
        cur.execute(f'SELECT * FROM "{ledger_schema}".runs WHERE run_key = %(k)s', {"k": run_key})
        row = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], row, strict=True)) if row else None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
