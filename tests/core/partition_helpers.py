"""Partitioned tables for the partition tests: built in SQL, measured with the tests' own SQL."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .helpers import CUTOFF, rows, scalar

# Seven months of 2024; CUTOFF (2024-06-01 12:00Z) makes January to May wholly expired, June straddle
# the cutoff and July newer than it.
MONTHS = [f"2024-{m:02d}-01" for m in range(1, 9)]
EXPIRED_MONTHS = ["m01", "m02", "m03", "m04", "m05"]


def create_monthly(
    admin: Any,
    schema: str,
    table: str = "events",
    *,
    rows_per_month: int = 2_000,
    default: bool = False,
    sub: str | None = None,
    status: str = "CASE WHEN mod(g, 7) = 0 THEN 'open' ELSE 'closed' END",
) -> str:
    """``schema.table`` partitioned by month of ``created_at`` (primary key (id, created_at)), months
    ``m01``..``m07``, optionally a DEFAULT partition (holding rows of 2023) and ``sub`` ("hash" or
    "list") sub-partitions of every month by tenant. Returns the quoted name."""
    name = f'"{schema}"."{table}"'
    rows(
        admin,
        f"CREATE TABLE {name} (id bigint NOT NULL, tenant_id integer NOT NULL, created_at timestamptz NOT NULL,"
        " status text NOT NULL, payload text" + ("" if sub else ", PRIMARY KEY (id, created_at)") + ")"
        " PARTITION BY RANGE (created_at)",
    )
    for i in range(7):
        part = f'"{schema}"."m{i + 1:02d}"'
        spec = f"FOR VALUES FROM ('{MONTHS[i]}') TO ('{MONTHS[i + 1]}')"
        if sub == "hash":
            rows(admin, f"CREATE TABLE {part} PARTITION OF {name} {spec} PARTITION BY HASH (tenant_id)")
            for r in range(2):
                rows(
                    admin,
                    f'CREATE TABLE "{schema}"."m{i + 1:02d}_h{r}" PARTITION OF {part}'
                    f" FOR VALUES WITH (MODULUS 2, REMAINDER {r})",
                )
        elif sub == "list":
            rows(admin, f"CREATE TABLE {part} PARTITION OF {name} {spec} PARTITION BY LIST (tenant_id)")
            rows(admin, f'CREATE TABLE "{schema}"."m{i + 1:02d}_a" PARTITION OF {part} FOR VALUES IN (1, 2)')
            rows(admin, f'CREATE TABLE "{schema}"."m{i + 1:02d}_b" PARTITION OF {part} DEFAULT')
        else:
            rows(admin, f"CREATE TABLE {part} PARTITION OF {name} {spec}")
    if default:
        rows(admin, f'CREATE TABLE "{schema}"."other" PARTITION OF {name} DEFAULT')
    rows(admin, f"CREATE INDEX ON {name} (created_at)")
    # Evenly over the seven months (and 2023 in the DEFAULT partition), ids in time order.
    per_minute = 30 * 24 * 60 // rows_per_month
    total = rows_per_month * 7
    rows(
        admin,
        f"INSERT INTO {name} (id, tenant_id, created_at, status, payload)"
        f" SELECT g, 1 + mod(g, 3), timestamptz '2024-01-01' + g * interval '{per_minute} minutes',"
        f" {status}, md5(g::text) FROM generate_series(0, %(last)s::bigint) g"
        f" WHERE timestamptz '2024-01-01' + g * interval '{per_minute} minutes' < timestamptz '2024-08-01'",
        {"last": total + rows_per_month},
    )
    if default:
        rows(
            admin,
            f"INSERT INTO {name} SELECT -g, 1, timestamptz '2023-06-01' + g * interval '1 hour', 'closed', 'old'"
            " FROM generate_series(1, 500) g",
        )
    rows(admin, f"ANALYZE {name}")
    return name


def eligible_count(admin: Any, table: str, cutoff: datetime = CUTOFF, condition: str | None = None) -> int:
    extra = f" AND ({condition})" if condition else ""
    return scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at < %(c)s{extra}", {"c": cutoff})


def partitions_of(admin: Any, table: str) -> list[str]:
    """Every relation attached below ``table``, by name (pending detaches left out, as PostgreSQL does)."""
    return sorted(
        r[0] for r in rows(admin, f"SELECT relid::regclass::text FROM pg_partition_tree('{table}') WHERE level > 0")
    )


def relations_in(admin: Any, schema: str) -> set[str]:
    return {
        r[0]
        for r in rows(
            admin,
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %(s)s AND c.relkind IN ('r', 'p')",
            {"s": schema},
        )
    }


def pending_detach(admin: Any, schema: str) -> list[str]:
    return sorted(
        r[0]
        for r in rows(
            admin,
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(s)s AND i.inhdetachpending",
            {"s": schema},
        )
    )


HASH_LEAVES = ["t_h0", "t_h1", "t_h2", "t_h3"]
# Rows a night adds over the four leaves of create_hashed (about a thousand each).
NIGHTLY_ROWS = 4_000


def create_hashed(admin: Any, schema: str) -> str:
    """``schema.t`` hash-partitioned by id into the four leaves of :data:`HASH_LEAVES`, empty."""
    name = f'"{schema}"."t"'
    rows(
        admin,
        f"CREATE TABLE {name} (id bigint NOT NULL, created_at timestamptz NOT NULL, payload text)"
        " PARTITION BY HASH (id)",
    )
    for r, leaf in enumerate(HASH_LEAVES):
        rows(admin, f'CREATE TABLE "{schema}"."{leaf}" PARTITION OF {name} FOR VALUES WITH (MODULUS 4, REMAINDER {r})')
    return name


def insert_night(admin: Any, table: str, night: int, cutoff: Any) -> None:
    """A night's rows into every leaf (ids hashed over the four): all in the day before ``cutoff``."""
    rows(
        admin,
        f"INSERT INTO {table} SELECT g, %(c)s::timestamptz - (1 + mod(g, 1000)) * interval '1 minute', md5(g::text)"
        " FROM generate_series(%(first)s::bigint, %(last)s::bigint) g",
        {"c": cutoff, "first": night * 1_000_000, "last": night * 1_000_000 + NIGHTLY_ROWS - 1},
    )
    rows(admin, f"ANALYZE {table}")
