"""Tenant columns of types with a modifier (char(n), bit(n), varchar(n), numeric(p,s), a domain over
char(n)) are compared as stored: per-tenant retention, the per-tenant cap and key chunks of one tenant
find exactly that tenant's rows; a tenant value the column would store as another value is refused."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows, scalar
from tests.core.tenant_helpers import CREATED, purge

# type -> (tenant values as inserted, a tenant as a policy writes it, that tenant as the column prints it)
TYPES: dict[str, tuple[list[str], str, str]] = {
    "char(4)": (["acme", "acmf", "ab", "zed"], "acme", "acme"),
    "bit(4)": (["1010", "1011", "0001", "1111"], "1010", "1010"),
    "varchar(6)": (["acme", "acmeco", "ab", "zed"], "acme", "acme"),
    "numeric(6,2)": (["1.5", "1.51", "3", "10.01"], "1.5", "1.50"),
    "domain": (["acme", "acmf", "ab", "zed"], "acme", "acme"),  # a domain over char(4)
}


def tenant_table(admin: Any, schema: str, type_name: str, count: int = 4_000) -> str:
    """``events`` with a tenant column of ``type_name``, 4 tenants interleaved row by row, timestamps over
    100 days before the run's date (2024-07-01 12:00Z), every 7th row open."""
    column_type = type_name
    if type_name == "domain":
        rows(admin, f'CREATE DOMAIN "{schema}".code AS char(4)')
        column_type = f'"{schema}".code'
    table = create_events(admin, schema, tenant_type=column_type)
    values = ", ".join(f"'{v}'" for v in TYPES[type_name][0])
    fill_events(admin, table, count, tenant=f"(ARRAY[{values}])[1 + mod(g, 4)]::{column_type}", created=CREATED)
    return table


def eligible_by_tenant(admin: Any, table: str, protected: str | None = None) -> dict[str, set[int]]:
    """Ids a run may delete, per tenant as text, by the tests' own SQL: the 30-day cutoff for every tenant
    but ``protected`` (365 days: none of its rows)."""
    found = rows(admin, f"SELECT id, tenant_id::text FROM {table} WHERE status <> 'open' AND created_at < %(c)s",
                 {"c": CUTOFF})  # fmt: skip
    out: dict[str, set[int]] = {}
    for key, tenant in found:
        if tenant != protected:
            out.setdefault(tenant, set()).add(key)
    return out


def all_ids(admin: Any, table: str) -> set[int]:
    return {r[0] for r in rows(admin, f"SELECT id FROM {table}")}


@pytest.mark.parametrize("chunk_by", ["block", "key"])
@pytest.mark.parametrize("type_name", list(TYPES))
def test_a_tenant_with_a_longer_retention_keeps_its_rows(
    schema: str, conn: Any, admin: Any, type_name: str, chunk_by: str
) -> None:
    """Issue 21, item 1: with char(4), 'acme' was cast to character (char(1)), i.e. 'a', so acme's own
    365-day retention matched no row and its 60-day-old rows went at 30 days."""
    table = tenant_table(admin, schema, type_name)
    _, written, printed = TYPES[type_name]
    expected = eligible_by_tenant(admin, table, protected=printed)
    before = all_ids(admin, table)
    protected_rows = scalar(admin, f"SELECT count(*) FROM {table} WHERE tenant_id::text = %(t)s", {"t": printed})
    assert len(expected) == 3 and protected_rows == 1_000
    policy = make_policy(
        schema,
        chunk_by=chunk_by,
        tenant_column="tenant_id",
        tenant_retention={written: "365 days"},
        batch_size=200,
        chunk_rows=400,
    )
    plan = purge(conn, policy)
    gone = set().union(*expected.values())
    assert all_ids(admin, table) == before - gone  # exactly the eligible rows, none of the protected tenant
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE tenant_id::text = %(t)s", {"t": printed}) == 1_000
    assert sum(c["rows_deleted"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)) == len(gone)


@pytest.mark.parametrize("chunk_by", ["block", "key"])
@pytest.mark.parametrize("type_name", ["char(4)", "bit(4)", "domain"])
def test_the_per_tenant_cap_applies_to_a_tenant_column_with_a_modifier(
    schema: str, conn: Any, admin: Any, type_name: str, chunk_by: str
) -> None:
    """The tenants at their cap are left out by a list cast to the column's type: cast to char(1), the
    list held 'a' and the cap never stopped a tenant."""
    table = tenant_table(admin, schema, type_name)
    expected = {t: len(k) for t, k in eligible_by_tenant(admin, table).items()}
    cap, batch = 150, 50
    assert all(n > cap + batch for n in expected.values())
    policy = make_policy(
        schema,
        chunk_by=chunk_by,
        tenant_column="tenant_id",
        max_rows_per_tenant=cap,
        batch_size=batch,
        chunk_rows=100_000 if chunk_by == "block" else 400,
    )
    purge(conn, policy)
    left = {t: len(k) for t, k in eligible_by_tenant(admin, table).items()}
    deleted = {t: expected[t] - left.get(t, 0) for t in expected}
    assert all(cap <= n < cap + batch for n in deleted.values()), deleted


@pytest.mark.parametrize("type_name", list(TYPES))
def test_key_chunks_of_one_tenant_delete_its_rows(schema: str, conn: Any, admin: Any, type_name: str) -> None:
    """A key chunk that packs tenants takes one tenant at a time (``tenant = %(tenant)s::text::<type>``):
    cast to char(1), 'acme' matched nothing and the chunk completed as nothing_to_delete."""
    table = tenant_table(admin, schema, type_name, count=1_200)
    expected = eligible_by_tenant(admin, table)
    before = all_ids(admin, table)
    policy = make_policy(schema, chunk_by="key", tenant_column="tenant_id", batch_size=100, chunk_rows=10_000)
    plan = purge(conn, policy)
    assert any(c.tenants for c in plan.chunks)  # the tenants are packed: batches of one tenant each
    assert all_ids(admin, table) == before - set().union(*expected.values())
    chunks = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert {c["outcome"] for c in chunks} == {"deleted"}
    assert sum(c["rows_deleted"] for c in chunks) == sum(len(k) for k in expected.values())


@pytest.mark.parametrize(
    ("type_name", "written", "stored"),
    [("char(4)", "acmecorp", "acme"), ("varchar(6)", "acme-corp", "acme-c"), ("numeric(6,2)", "1.005", "1.01"),
     ("bit(4)", "10101", "1010"), ("domain", "acmecorp", "acme")],
)  # fmt: skip
def test_a_tenant_the_column_would_store_as_another_is_refused(
    schema: str, conn: Any, admin: Any, type_name: str, written: str, stored: str
) -> None:
    """A value cut or rounded by the cast would give its retention to another tenant ('acmecorp' is
    'acme' in a char(4)): refused, naming the field, before anything is deleted."""
    table = tenant_table(admin, schema, type_name, count=400)
    before = all_ids(admin, table)
    policy = make_policy(schema, chunk_by="block", tenant_column="tenant_id", tenant_retention={written: "1 day"})
    with pytest.raises(PermanentError) as info:
        purge(conn, policy)
    message = str(info.value)
    assert f"field 'tenant_retention': tenant {written!r} is not a value of column" in message
    assert f"store it as {stored!r}" in message
    assert all_ids(admin, table) == before


def test_the_catalog_reads_types_with_their_modifier_and_refuses_an_array(schema: str, conn: Any, admin: Any) -> None:
    tenant_table(admin, schema, "domain", count=10)
    policy = make_policy(schema, chunk_by="block", tenant_column="tenant_id")
    info = inspect_target(conn, policy)
    assert info.tenant_type == f"{schema}.code" and info.tenant_base_type == "pg_catalog.bpchar"
    rows(admin, f'ALTER TABLE "{schema}".events ALTER COLUMN tenant_id TYPE character(6)')
    info = inspect_target(conn, policy)
    assert info.tenant_type == "character(6)" and info.tenant_base_type == "pg_catalog.bpchar"
    rows(admin, f'ALTER TABLE "{schema}".events ALTER COLUMN tenant_id TYPE text[] USING ARRAY[tenant_id]')
    with pytest.raises(PermanentError, match=r"field 'tenant_column': column tenant_id is text\[\], an array"):
        inspect_target(conn, policy)


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_a_lookup_table_tenant_of_a_char_column(schema: str, conn: Any, admin: Any, chunk_by: str) -> None:
    """``tenant_retention_table`` with a text tenant column, for a char(4) tenant column of the target:
    acme's 365 days apply to acme's rows; a value the column would cut is refused, naming the field."""
    table = tenant_table(admin, schema, "char(4)")
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id text, retention interval)')
    rows(admin, f"""INSERT INTO "{schema}".keep VALUES ('acme', '365 days'), ('ab', '40 days')""")
    gone = set().union(*eligible_by_tenant(admin, table, protected="acme").values())
    before = all_ids(admin, table)
    policy = make_policy(
        schema, chunk_by=chunk_by, tenant_column="tenant_id", tenant_retention_table=f"{schema}.keep", chunk_rows=400
    )
    purge(conn, policy)
    # 'ab' keeps 40 days: its rows between 40 and 30 days old stay too.
    ab_kept = {r[0] for r in rows(admin, f"SELECT id FROM {table} WHERE tenant_id = 'ab' AND created_at >= %(c)s",
                                  {"c": CUTOFF.replace(month=5, day=22)})}  # fmt: skip
    assert all_ids(admin, table) == before - (gone - ab_kept)
    assert ab_kept & gone  # the test shows the difference
    rows(admin, f"""INSERT INTO "{schema}".keep VALUES ('acmecorp', '1 day')""")
    with pytest.raises(PermanentError, match=r"field 'tenant_retention_table': tenant 'acmecorp' is not a value"):
        purge(conn, make_policy(schema, name="another_run", chunk_by=chunk_by, tenant_column="tenant_id",
                                tenant_retention_table=f"{schema}.keep"))  # fmt: skip


def test_a_lone_chunk_naming_a_tenant_the_column_would_store_as_another_is_refused(
    schema: str, conn: Any, admin: Any
) -> None:
    """``tenants=['acmecorp']`` on a char(4) column: the cast would purge acme's rows and count them under
    'acmecorp'. Refused before any ledger row or deletion; the tenant as stored works."""
    table = tenant_table(admin, schema, "char(4)", count=400)
    before = all_ids(admin, table)
    policy = make_policy(schema, chunk_by="key", tenant_column="tenant_id")
    with pytest.raises(PermanentError, match="field 'tenants': tenant 'acmecorp' is not a value of column"):
        run_chunk(conn, policy, CUTOFF, ChunkSpec(key="lone", lo=0, hi=10**9, tenants=("acmecorp",)), lone=True)
    assert all_ids(admin, table) == before
    assert scalar(admin, f'SELECT count(*) FROM "{policy.ledger_schema}".runs') == 0
    acme = eligible_by_tenant(admin, table)["acme"]
    result = run_chunk(conn, policy, CUTOFF, ChunkSpec(key="lone2", lo=0, hi=10**9, tenants=("acme",)), lone=True)
    assert result.rows_deleted == len(acme) > 0
    assert all_ids(admin, table) == before - acme
