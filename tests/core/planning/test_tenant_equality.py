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
    return make_policy(schema, **{"condition": None, "tenant_column": "tenant_id", "chunk_rows": 200, **fields})


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


def _spelled_table(admin: Any, schema: str) -> str:
    """A citext tenant written two ways: rows 1-500 'ACME', 501-1000 'acme' (one tenant), all expired."""
    rows(admin, "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public")
    table = f'"{schema}"."events"'
    rows(
        admin,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, tenant_id public.citext, created_at timestamptz NOT NULL,"
        " status text NOT NULL)",
    )
    rows(
        admin,
        f"INSERT INTO {table} SELECT g, CASE WHEN g <= 500 THEN 'ACME' ELSE 'acme' END,"
        " %(a)s::timestamptz - interval '100 days', 'closed' FROM generate_series(1, 1000) AS g",
        {"a": ANCHOR},
    )
    rows(admin, f"ANALYZE {table}")
    return table


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_a_dead_letters_retry_takes_every_spelling_of_its_tenant(
    schema: str, conn: Any, admin: Any, chunk_by: str
) -> None:
    """Rows of the dead-lettered tenant spelled otherwise than the letter must still fail, stay and keep the
    letter open on the retry: a retry that compared spellings skipped them and closed the letter while
    verify said complete (found by review). Its recorded cutoff is the override's, spelled otherwise too."""
    from airflow_retention.core.errors import PermanentError
    from airflow_retention.core.running.verify import verify_run

    table = _spelled_table(admin, schema)
    rows(admin, f'CREATE TABLE "{schema}".refs (eid bigint REFERENCES {table} (id))')
    rows(admin, f'INSERT INTO "{schema}".refs VALUES (1), (900)')
    policy = _policy(
        schema, chunk_by=chunk_by, chunk_rows=100_000, batch_size=100, tenant_retention={"Acme": "60 days"}
    )
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    ledger, keys = Ledger(policy.ledger_schema), [c.key for c in plan.chunks]
    (chunk,) = plan.chunks
    with pytest.raises(PermanentError, match="foreign key"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    (letter,) = rows(admin, f'SELECT tenant, cutoff FROM "{policy.ledger_schema}".dead_letters')
    assert letter[1] == ANCHOR - timedelta(days=60)  # the override 'Acme' is the tenant's cutoff
    # The reference to row 1 ('ACME') removed, row 900 ('acme') still referenced: the retry fails again.
    rows(admin, f'DELETE FROM "{schema}".refs WHERE eid = 1')
    with pytest.raises(PermanentError, match="foreign key"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert rows(admin, f"SELECT count(*) FROM {table} WHERE id = 900")[0][0] == 1
    assert not verify_run(conn, ledger, plan.run_key, keys).ok
    rows(admin, f'DELETE FROM "{schema}".refs')
    run_chunk(conn, policy, plan.cutoff, chunk)
    assert rows(admin, f"SELECT count(*) FROM {table}")[0][0] == 0
    assert verify_run(conn, ledger, plan.run_key, keys).ok


@pytest.mark.parametrize("archive", [False, True])
def test_the_cap_counts_every_spelling_of_a_tenant_together(schema: str, conn: Any, admin: Any, archive: bool) -> None:
    """max_rows_per_tenant of a tenant written three ways: its spellings count together (the cap, plus at
    most the batch that crossed it), and with an archive one row per tenant and batch is counted."""
    table = f'"{schema}"."events"'
    rows(admin, "CREATE EXTENSION IF NOT EXISTS citext SCHEMA public")
    rows(
        admin,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, tenant_id public.citext, created_at timestamptz NOT NULL,"
        " status text NOT NULL)",
    )
    rows(
        admin,
        f"INSERT INTO {table} SELECT g, (ARRAY['acme', 'ACME', 'Acme'])[1 + g %% 3],"
        " %(a)s::timestamptz - interval '100 days', 'closed' FROM generate_series(1, 3000) AS g",
        {"a": ANCHOR},
    )
    rows(admin, f"ANALYZE {table}")
    extra: dict[str, Any] = {}
    if archive:
        rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
        extra["archive_table"] = f"{schema}.archive"
    policy = _policy(schema, chunk_by="block", chunk_rows=100_000, batch_size=100, max_rows_per_tenant=300, **extra)
    plan = _purge(conn, policy)
    deleted = 3000 - rows(admin, f"SELECT count(*) FROM {table}")[0][0]
    # The cap and the batch that crossed it (block batches of about 100 rows); per spelling it was 952.
    assert 300 <= deleted < 500, deleted
    per_batch = rows(
        admin,
        f'SELECT max(batches) FROM "{policy.ledger_schema}".tenant_counts WHERE run_key = %(k)s',
        {"k": plan.run_key},
    )[0][0]
    (chunk,) = rows(
        admin,
        f'SELECT batches, rows_deleted FROM "{policy.ledger_schema}".chunks WHERE run_key = %(k)s',
        {"k": plan.run_key},
    )
    assert chunk[1] == deleted
    # Every batch that deleted counted the tenant once: no spelling has more batches than the chunk, and
    # the spellings' batch counts add up to at most the chunk's.
    spellings = rows(
        admin,
        f'SELECT sum(batches), sum(rows_deleted) FROM "{policy.ledger_schema}".tenant_counts WHERE run_key = %(k)s',
        {"k": plan.run_key},
    )[0]
    assert per_batch <= chunk[0] and spellings[0] <= chunk[0] and spellings[1] == deleted
