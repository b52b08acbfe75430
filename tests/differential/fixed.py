"""Fixed cases of the differential suite: one per shape issue 32's review found beyond the generator's
reach, run on every CI run beside the generated ones (``test_differential.py::test_fixed``). Each is a
plain :class:`~.cases.Case`, checked by the same harness and oracle; the generator draws the same shapes
(with other values) in its searches.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from .cases import Case

UTC = timezone.utc
RUN_DATE = datetime(2024, 12, 31, tzinfo=UTC)
NAMES = {"table": "events", "ts": "created_at", "tenant": "tenant_id", "key": "id", "status": "status"}


def _case(
    tenant_type: str | None,
    rows: list[list[Any]],
    policy: dict[str, Any],
    *,
    partition: str | None = None,
    default: bool = False,
    tenant_table: list[list[Any]] | None = None,
    faults: dict[str, Any] | None = None,
    planner: dict[str, Any] | None = None,
    run_date: datetime = RUN_DATE,
    **table: Any,
) -> Case:
    return Case(
        table={
            "wide": False,
            "planner": planner or {},
            "names": dict(NAMES),
            "ts_type": "timestamptz",
            "tenant_type": tenant_type,
            "key_kind": "bigint" if partition is None else "none",
            "partition": partition,
            "default": default,
            "ts_index": True,
            **table,
        },
        rows=rows,
        refs=[],
        tenant_table=tenant_table,
        policy={
            "name": "diff",
            "conn_id": "retention_target",
            "timestamp_column": "created_at",
            "chunk_by": "block",
            "batch_size": 7,
            "chunk_rows": 21,
            "target_batch_time": 0,
            "min_batch_size": 1,
            "lock_timeout": "3s",
            "statement_timeout": "30s",
            **({"tenant_column": "tenant_id"} if tenant_type else {}),
            **policy,
        },
        condition=None,
        run_date=run_date.isoformat(),
        faults=faults or {},
    )


def _rows(tenants: list[str], ages: list[float], seed: int, run_date: datetime = RUN_DATE) -> list[list[Any]]:
    """Rows of each tenant value (as written: 'ACME' and 'acme' are rows of one citext tenant), one per
    age in days before the run date; statuses and numbers drawn from ``seed``."""
    rnd = random.Random(seed)
    out = []
    for tenant in tenants:
        for age in ages:
            rid = len(out) + 1
            ts = run_date - timedelta(days=age, seconds=rnd.randint(0, 3600))
            out.append([rid, rid * 3 + 1000, ts.isoformat(), tenant, rnd.choice(["open", "closed"]), rnd.randint(0, 9)])
    return out


AGES = [1, 4, 6.5, 7.5, 9, 12, 20, 29.5, 30.5, 45, 59, 61, 80, 100, 200, 364, 366]


def citext_two_keys() -> Case:
    """Issue 32's reproduction: a citext tenant column, ``{acme: 365 days, ACME: 7 days}``: one tenant,
    whose longest retention applies to all its rows however they are written (193 of 200 acme rows went
    at the 7-day cutoff)."""
    rows = _rows(["acme", "ACME", "Acme", "globex"], AGES, seed=1)
    return _case("citext", rows, {"retention": "30 days", "tenant_retention": {"acme": "365 days", "ACME": "7 days"}})


def collation_map_over_table() -> Case:
    """A text column under a case-insensitive ICU collation, key chunks listing their tenants: the lookup
    table names acme twice (its longest, 60 days, applies) and Globex, which the map names too (the
    map's 10 days win over the table's 90, written another way)."""
    rows = _rows(["acme", "ACME", "Globex", "GLOBEX", "init co"], AGES, seed=2)
    policy = {
        "chunk_by": "key",
        "key_column": "id",
        "retention": "30 days",
        "tenant_retention": {"Globex": "10 days"},
        "tenant_retention_table": "tenant_ret",
    }
    table = [["GLOBEX", "90 days"], ["acme", "5 days"], ["ACME", "60 days"]]
    return _case("ci_text", rows, policy, tenant_table=table)


def numeric_scales() -> Case:
    """An unconstrained numeric tenant column: 7, 7.0 and 7.00 are one tenant, and so are 1.5 and 1.50,
    whichever way rows, map keys and lookup rows write them."""
    rows = _rows(["7", "7.0", "7.00", "1.5", "1.50", "10"], AGES, seed=3)
    policy = {
        "retention": "30 days",
        "tenant_retention": {"7": "3 days", "7.00": "40 days"},
        "tenant_retention_table": "tenant_ret",
    }
    table = [["7.0", "20 days"], ["1.50", "2 days"], ["1.5", "25 days"], ["10.000", "8 days"]]
    return _case("numeric", rows, policy, tenant_table=table)


def dead_letter_redo_archive() -> Case:
    """A tenant's rows held by a foreign key after planning (a dead letter), retried once while held, then
    released: the redo's rows deleted, archived and its batches count in the chunks' ledger rows."""
    rows = _rows(["acme", "globex", "init"], AGES * 2, seed=4)
    policy = {"retention": "30 days", "archive_table": "archive", "tenant_retention": {"globex": "10 days"}}
    return _case("text", rows, policy, faults={"kind": "dead_letter", "how": "fk", "seed": 1, "after_batches": 1})


def dead_letter_redo_key_chunks() -> Case:
    """The same with key chunks listing their tenants, held by a trigger, with an archive table."""
    rows = _rows(["acme", "globex", "init"], AGES * 2, seed=5)
    policy = {"chunk_by": "key", "key_column": "id", "retention": "30 days", "archive_table": "archive"}
    return _case("text", rows, policy, faults={"kind": "dead_letter", "how": "trigger", "seed": 2, "after_batches": 0})


def dead_letter_redo_dry_run() -> Case:
    """A dry run whose count fails for one tenant until released: the redo's matched rows and batches
    count in the chunk's ledger row and in tenant_counts."""
    rows = _rows(["acme", "globex", "init"], AGES * 2, seed=6)
    policy = {"retention": "30 days", "dry_run": True, "archive_table": "archive"}
    return _case(
        "text", rows, policy, faults={"kind": "dead_letter", "how": "condition", "seed": 3, "after_batches": 1}
    )


def key_fallback_cap() -> Case:
    """Key chunks with more tenants than the chunks can list (MAX_TENANTS_PER_CHUNK 1, max_chunks 2): the
    planner's fallback to key ranges across tenants must still count each tenant (tenant_counts) and stop
    it at max_rows_per_tenant (past it by at most one batch)."""
    rows = _rows(["a", "b", "c", "d", "e"], AGES, seed=7)
    policy = {"chunk_by": "key", "key_column": "id", "retention": "5 days", "batch_size": 3, "chunk_rows": 6,
              "max_rows_per_tenant": 4}  # fmt: skip
    return _case("text", rows, policy, planner={"max_tenants_per_chunk": 1, "max_chunks": 2})


def key_fallback_dry_run() -> Case:
    """The fallback in a dry run: tenant_counts must hold every tenant's matched rows."""
    rows = _rows(["a", "b", "c", "d"], AGES, seed=8)
    policy = {"chunk_by": "key", "key_column": "id", "retention": "5 days", "batch_size": 4, "dry_run": True}
    return _case("text", rows, policy, planner={"max_tenants_per_chunk": 1, "max_chunks": 1})


def _night_rows(count: int, seed: int, tenants: list[str | None]) -> list[list[Any]]:
    rnd = random.Random(seed)
    out = []
    for rid in range(1, count + 1):
        ts = RUN_DATE - timedelta(days=rnd.uniform(0, 60))
        out.append([rid, rid * 3 + 1000, ts.isoformat(), tenants[rid % len(tenants)], "closed", rnd.randint(0, 9)])
    return out


def nights_list_budget_one() -> Case:
    """LIST partitions (3 leaves) and a budget of 1 chunk, 4 nights, rows into every leaf each day: each
    night covers the least recently covered leaf, so no leaf waits more than 3 nights."""
    rows = _night_rows(40, seed=9, tenants=["acme", "globex", "init co", "o'hara"])
    policy = {"retention": "14 days", "expired_partitions": "delete"}
    return _case("text", rows, policy, partition="list", default=True, planner={"max_chunks": 1},
                 faults={"kind": "nights", "nights": 4, "seed": 4})  # fmt: skip


def nights_range_hash() -> Case:
    """Monthly RANGE partitions of 2 HASH leaves each and a DEFAULT one (19 leaves), a budget of 5, 5
    nights: every leaf covered within ceil(19 / 5) = 4 nights, late rows into old months included."""
    rows = _night_rows(60, seed=10, tenants=[None])
    rows = [r for r in rows if datetime.fromisoformat(r[2]) >= datetime(2024, 6, 1, tzinfo=UTC)]
    policy = {"retention": "20 days", "expired_partitions": "delete"}
    return _case(None, rows, policy, partition="range_hash", default=True, planner={"max_chunks": 5},
                 faults={"kind": "nights", "nights": 5, "seed": 5})  # fmt: skip


def inheritance_child() -> Case:
    """A plain table with an inheritance child: refused, naming the table; nothing deleted."""
    rows = _rows(["acme"], AGES, seed=11)
    return _case("text", rows, {"retention": "30 days"}, inherit_child=True)


FIXED: dict[str, Callable[[], Case]] = {
    f.__name__: f
    for f in (
        citext_two_keys,
        collation_map_over_table,
        numeric_scales,
        dead_letter_redo_archive,
        dead_letter_redo_key_chunks,
        dead_letter_redo_dry_run,
        key_fallback_cap,
        key_fallback_dry_run,
        nights_list_budget_one,
        nights_range_hash,
        inheritance_child,
    )
}
