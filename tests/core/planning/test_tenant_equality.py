"""Issue 32, defect 1, on both drivers: tenant entries are one tenant when the tenant column compares
them equal (``citext``, a nondeterministic collation, ``numeric`` scales), not when they print alike;
the longest retention among them wins, the policy's map over the lookup table, and no row of such a
tenant is deleted at the shorter entry's cutoff."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CUTOFF, make_policy, rows
from tests.core.tenant_helpers import ANCHOR

# Each kind of column that compares values printed differently as equal, with the acme tenant's rows
# written several ways, the other tenant ('other'/8) written once.
COLUMNS = {
    "citext": ("citext", ["acme", "ACME", "Acme"], "other"),
    "icu": ('text COLLATE "{schema}"."ci"', ["acme", "ACME", "Acme"], "other"),
    "numeric": ("numeric", ["7", "7.0", "7.00"], "8"),
}


def _table(admin: Any, schema: str, kind: str) -> tuple[str, list[str], str]:
    column, spellings, other = COLUMNS[kind]
    if kind == "citext":
        rows(admin, "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public")
        column = "public.citext"
    if kind == "icu":
        rows(
            admin,
            f'CREATE COLLATION "{schema}"."ci" (provider = icu, locale = \'und-u-ks-level2\', deterministic = false)',
        )
        column = column.format(schema=schema)
    table = f'"{schema}"."events"'
    rows(
        admin,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, tenant_id {column}, created_at timestamptz NOT NULL,"
        " status text NOT NULL)",
    )
    rows(admin, f"CREATE INDEX ON {table} (created_at)")
    rows(admin, f"CREATE INDEX ON {table} (tenant_id, id)")
    # 600 rows a tenant spelling, timestamps spread over the 100 days before the run's date.
    values = [*spellings, other]
    rows(
        admin,
        f"INSERT INTO {table} SELECT g, (%(v)s::text[])[1 + g %% {len(values)}]::text::{column},"
        " %(a)s::timestamptz - (g %% 100) * interval '1 day' - interval '1 hour', 'closed'"
        f" FROM generate_series(1, {150 * len(values)}) AS g",
        {"v": values, "a": ANCHOR},
    )
    rows(admin, f"ANALYZE {table}")
    return table, spellings, other


def _survivors(admin: Any, table: str, other: str) -> tuple[int, int]:
    """(rows of the acme tenant, rows of the other tenant older than the policy's 30 days) left."""
    acme = _acme_rows(admin, table, other)
    old = rows(
        admin,
        f"SELECT count(*) FROM {table} WHERE tenant_id::text = %(o)s AND created_at < %(c)s",
        {"o": other, "c": CUTOFF},
    )[0][0]
    return acme, old


def _acme_rows(admin: Any, table: str, other: str) -> int:
    return rows(admin, f"SELECT count(*) FROM {table} WHERE tenant_id::text <> %(o)s", {"o": other})[0][0]


def _policy(schema: str, **fields: Any) -> Any:
    return make_policy(schema, condition=None, tenant_column="tenant_id", chunk_rows=200, **fields)


def _purge(conn: Any, policy: Any) -> Any:
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    return plan


@pytest.mark.parametrize("chunk_by", ["block", "key"])
@pytest.mark.parametrize("kind", sorted(COLUMNS))
def test_two_map_entries_equal_in_the_column_give_the_longest_retention(
    schema: str, conn: Any, admin: Any, kind: str, chunk_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    table, spellings, other = _table(admin, schema, kind)
    before = _acme_rows(admin, table, other)
    # Sorted by text, the 7-day entry comes first: array_position used to take it for every spelling.
    policy = _policy(schema, chunk_by=chunk_by, tenant_retention={spellings[0]: "365 days", spellings[1]: "7 days"})
    with caplog.at_level(logging.WARNING, logger="airflow_retention"):
        plan = _purge(conn, policy)
    frozen = Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)
    assert [(r, c) for _, r, c, _ in frozen] == [("365 days", ANCHOR - timedelta(days=365))]
    assert _survivors(admin, table, other) == (before, 0)
    warned = [r.getMessage() for r in caplog.records if "tenant_retention lists tenant" in r.getMessage()]
    assert warned and "2 times (retention 365 days, 7 days)" in warned[0], warned


@pytest.mark.parametrize("kind", sorted(COLUMNS))
def test_lookup_table_rows_equal_in_the_column_give_the_longest_retention(
    schema: str, conn: Any, admin: Any, kind: str
) -> None:
    table, spellings, other = _table(admin, schema, kind)
    column = rows(
        admin,
        "SELECT format_type(atttypid, atttypmod), (SELECT collname FROM pg_collation WHERE oid = attcollation)"
        " FROM pg_attribute WHERE attrelid = %(t)s::regclass AND attname = 'tenant_id'",
        {"t": table},
    )[0]
    collate = f' COLLATE "{schema}"."ci"' if column[1] == "ci" else ""
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id {column[0]}{collate}, retention interval)')
    rows(
        admin,
        f"""INSERT INTO "{schema}".keep VALUES (%(a)s, '365 days'), (%(b)s, '7 days')""",
        {"a": spellings[0], "b": spellings[2]},
    )
    before = _acme_rows(admin, table, other)
    policy = _policy(schema, chunk_by="block", tenant_retention_table=f"{schema}.keep")
    _purge(conn, policy)
    assert _survivors(admin, table, other) == (before, 0)


def test_the_policy_map_wins_over_a_lookup_row_equal_in_the_column(schema: str, conn: Any, admin: Any) -> None:
    table, _, other = _table(admin, schema, "citext")
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id public.citext, retention interval)')
    rows(admin, f"""INSERT INTO "{schema}".keep VALUES ('acme', '7 days')""")
    before = _acme_rows(admin, table, other)
    policy = _policy(
        schema, chunk_by="block", tenant_retention_table=f"{schema}.keep", tenant_retention={"ACME": "365 days"}
    )
    plan = _purge(conn, policy)
    frozen = Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)
    assert [(t, r, s) for t, r, _, s in frozen] == [("ACME", "365 days", "policy")]
    assert _survivors(admin, table, other) == (before, 0)
