"""Catalog checks of the target table, on the real PostgreSQL with both drivers."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError, PolicyError
from tests.core.helpers import create_events, make_policy, rows


def permanent(conn: Any, policy: Any) -> str:
    with pytest.raises(PermanentError) as info:
        inspect_target(conn, policy)
    return str(info.value)


def test_good_table(schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture) -> None:
    create_events(admin, schema)
    with caplog.at_level(logging.WARNING):
        info = inspect_target(conn, make_policy(schema, tenant_column="tenant_id"))
    assert info.timestamp_has_tz is True
    assert info.tenant_type == "integer"
    assert info.columns == ("id", "tenant_id", "created_at", "status", "payload")
    assert info.warnings == ()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(("key_type", "ts_type"), [("integer", "timestamp"), ("smallint", "timestamptz")])
def test_other_accepted_types(schema: str, conn: Any, admin: Any, key_type: str, ts_type: str) -> None:
    create_events(admin, schema, key_type=key_type, ts_type=ts_type, tenant_type="text")
    info = inspect_target(conn, make_policy(schema, tenant_column="tenant_id"))
    assert info.timestamp_has_tz is (ts_type == "timestamptz")
    assert info.tenant_type == "text"


def test_unique_index_instead_of_primary_key_is_enough(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema, key_index="unique")
    assert inspect_target(conn, make_policy(schema)).columns[0] == "id"


def test_missing_table(schema: str, conn: Any) -> None:
    message = permanent(conn, make_policy(schema))
    assert f"{schema}.events does not exist" in message
    assert "events_purge" in message


def test_table_name_is_case_sensitive(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema)
    assert "does not exist" in permanent(conn, make_policy(schema, table=f"{schema}.Events"))


@pytest.mark.parametrize("field", ["key_column", "timestamp_column", "tenant_column"])
def test_missing_column(schema: str, conn: Any, admin: Any, field: str) -> None:
    create_events(admin, schema)
    message = permanent(conn, make_policy(schema, **{field: "no_such_col"}))
    assert f"field {field!r}" in message
    assert "column no_such_col does not exist" in message


@pytest.mark.parametrize("key_type", ["numeric", "text", "uuid"])
def test_non_integer_key(schema: str, conn: Any, admin: Any, key_type: str) -> None:
    create_events(admin, schema, key_type=key_type)
    message = permanent(conn, make_policy(schema))
    assert "field 'key_column'" in message
    assert key_type in message


@pytest.mark.parametrize("ts_type", ["date", "text", "bigint"])
def test_non_timestamp_column(schema: str, conn: Any, admin: Any, ts_type: str) -> None:
    create_events(admin, schema, ts_type=ts_type)
    message = permanent(conn, make_policy(schema))
    assert "field 'timestamp_column'" in message
    assert ts_type in message


@pytest.mark.parametrize("key_index", ["none", "plain", "partial", "composite"])
def test_key_without_unique_index(schema: str, conn: Any, admin: Any, key_index: str) -> None:
    create_events(admin, schema, key_index=key_index)
    message = permanent(conn, make_policy(schema))
    assert "field 'key_column'" in message
    assert "no unique index" in message


def test_missing_timestamp_index_is_a_warning(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    create_events(admin, schema, ts_index=False, tenant_index=False)
    with caplog.at_level(logging.WARNING, logger="airflow_retention.core.db.catalog"):
        info = inspect_target(conn, make_policy(schema, tenant_column="tenant_id"))
    assert len(info.warnings) == 2
    assert "no index starts with 'created_at'" in info.warnings[0]
    assert "(tenant_id, id)" in info.warnings[1]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == list(info.warnings)


def test_archive_table(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema)
    policy = make_policy(schema, archive_table=f"{schema}.events_archive")
    message = permanent(conn, policy)
    assert "field 'archive_table'" in message
    assert "does not exist" in message
    rows(admin, f'CREATE TABLE "{schema}".events_archive (LIKE "{schema}".events)')
    assert inspect_target(conn, policy).columns[0] == "id"
    rows(admin, f'ALTER TABLE "{schema}".events_archive DROP COLUMN payload')
    message = permanent(conn, policy)
    assert "field 'archive_table'" in message
    assert "lacks column(s) payload" in message


@pytest.mark.parametrize("condition", ["no_such_col = 1", "status = 1", "status <> 'open' and", "nosuchfunc(status)"])
def test_invalid_condition_sql(schema: str, conn: Any, admin: Any, condition: str) -> None:
    create_events(admin, schema)
    message = permanent(conn, make_policy(schema, condition=condition))
    assert "'condition'" in message


def test_catalog_check_leaves_the_connection_idle(schema: str, conn: Any, admin: Any) -> None:
    create_events(admin, schema)
    inspect_target(conn, make_policy(schema))
    with pytest.raises(PermanentError):
        inspect_target(conn, make_policy(schema, condition="no_such_col = 1"))
    # No transaction of this connection is left open holding locks on the table.
    assert not rows(
        admin,
        "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.relation = %(t)s::regclass AND a.pid <> pg_backend_pid()",
        {"t": f'"{schema}".events'},
    )


def test_archive_table_resolving_to_the_target_itself_is_refused(schema: str, conn: Any, admin: Any) -> None:
    """``table: <schema>.events`` and ``archive_table: events`` name one table when the schema is on the
    search_path. The purge would then "move" each row into the table it came from: nothing is deleted
    while the ledger counts every row as deleted and archived."""
    create_events(admin, schema)
    with conn.cursor() as cur:
        cur.execute(f'SET search_path TO "{schema}"')
    conn.commit()
    policy = make_policy(schema, archive_table="events")
    message = permanent(conn, policy)
    assert "field 'archive_table'" in message


def _server_accepts(admin: Any, value: str) -> bool:
    (values,) = rows(admin, "SELECT enumvals FROM pg_catalog.pg_settings WHERE name = 'wal_compression'")[0]
    return values is not None and value in values


def test_batches_set_wal_compression_lz4_when_the_role_may(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    create_events(admin, schema)
    (current,) = rows(admin, "SELECT current_setting('wal_compression')")[0]
    lz4 = _server_accepts(admin, "lz4")
    assert make_policy(schema).wal_compression == "server"
    assert inspect_target(conn, make_policy(schema)).wal_compression is None
    with caplog.at_level(logging.INFO):
        auto = inspect_target(conn, make_policy(schema, wal_compression="auto")).wal_compression
    # The tests' role is a superuser: auto takes lz4 unless the server has it already (or lacks it).
    assert auto == ("lz4" if lz4 and current != "lz4" else None)
    if auto:
        assert "batches set wal_compression = lz4" in caplog.text
    assert inspect_target(conn, make_policy(schema, wal_compression="PGLZ")).wal_compression == (
        None if current == "pglz" else "pglz"
    )
    # The probe is local to its own transaction: the session's setting is untouched.
    assert rows(admin, "SELECT current_setting('wal_compression')")[0][0] == current


@pytest.mark.parametrize("value", ["gzip", "", 1, None, True])
def test_a_wal_compression_the_policy_does_not_know_is_refused(value: object) -> None:
    with pytest.raises(PolicyError, match="wal_compression"):
        make_policy("s", wal_compression=value)


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_a_table_with_inheritance_children_is_refused_and_nothing_is_deleted(
    schema: str, conn: Any, admin: Any, chunk_by: str
) -> None:
    """Issue 32, item 5: a statement on the parent reaches the children's rows, which block chunks (the
    parent's TID ranges) cannot cover: the policy is refused at planning, naming the field and the child."""
    from airflow_retention.core.planning.planner import plan_run
    from tests.core.helpers import CUTOFF, fill_events, scalar

    table = create_events(admin, schema)
    fill_events(admin, table, 200)
    rows(admin, f'CREATE TABLE "{schema}".events_2023 () INHERITS ({table})')
    rows(
        admin,
        f"""INSERT INTO "{schema}".events_2023 SELECT id + 1000, tenant_id, created_at, status, payload FROM {table}""",
    )
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    policy = make_policy(schema, chunk_by=chunk_by)
    message = permanent(conn, policy)
    assert "field 'table'" in message and "1 inheritance child table(s)" in message
    assert f"{schema}.events_2023" in message and "nothing was deleted" in message
    with pytest.raises(PermanentError, match="inheritance child"):
        plan_run(conn, policy, CUTOFF)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before == 400
    # The child alone is a plain table without children: its own policy is accepted.
    rows(admin, f'ALTER TABLE "{schema}".events_2023 ADD PRIMARY KEY (id)')
    inspect_target(conn, make_policy(schema, table=f"{schema}.events_2023", chunk_by=chunk_by))
