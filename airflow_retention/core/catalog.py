"""What the catalog says about a policy's target table, checked once before any delete."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from airflow_retention.core import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.identifiers import TableName, quote_ident
from airflow_retention.core.policy import RetentionPolicy

log = logging.getLogger(__name__)

_INTEGER_TYPES = {"smallint", "integer", "bigint"}
_TIMESTAMP_TYPES = {"timestamp with time zone", "timestamp without time zone"}

_COLUMNS_SQL = """
SELECT a.attname, format_type(a.atttypid, NULL), a.attnum
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = %(rel)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

# The leading columns of every valid index on the table, plus whether it is unique.
_INDEXES_SQL = """
SELECT i.indisunique,
       i.indnkeyatts,
       ARRAY(SELECT a.attname::text
             FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             WHERE k.ord <= i.indnkeyatts
             ORDER BY k.ord)
FROM pg_catalog.pg_index i
WHERE i.indrelid = %(rel)s::regclass AND i.indisvalid AND i.indpred IS NULL
"""


@dataclass(frozen=True)
class TargetInfo:
    """The facts about the target table that shape the SQL the engine runs."""

    timestamp_has_tz: bool
    tenant_type: str | None
    columns: tuple[str, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _relation_exists(conn: Any, table: TableName) -> bool:
    rows = dbapi.fetch_all(conn, "SELECT to_regclass(%(rel)s) IS NOT NULL", {"rel": table.regclass_literal})
    return bool(rows[0][0])


def inspect_target(conn: Any, policy: RetentionPolicy) -> TargetInfo:
    """Check the table, its columns, types and indexes against the policy; raise :class:`PermanentError`
    naming what is wrong, and log a warning for each missing index that will make the purge slow."""
    where = f"policy {policy.name!r}"
    if not _relation_exists(conn, policy.table):
        raise PermanentError(
            f"{where}: table {policy.table} does not exist (or this role cannot see it)"
            f" in connection {policy.conn_id!r}"
        )
    rel = {"rel": policy.table.regclass_literal}
    columns = {name: typ for name, typ, _ in dbapi.fetch_all(conn, _COLUMNS_SQL, rel)}
    ordered = tuple(name for name, _, _ in dbapi.fetch_all(conn, _COLUMNS_SQL, rel))

    def column_type(field_name: str, column: str) -> str:
        if column not in columns:
            raise PermanentError(
                f"{where}: field {field_name!r}: column {column!r} does not exist in {policy.table}"
                f" (columns: {', '.join(ordered)})"
            )
        return columns[column]

    key_type = column_type("key_column", policy.key_column)
    if key_type not in _INTEGER_TYPES:
        raise PermanentError(
            f"{where}: field 'key_column': column {policy.key_column!r} is {key_type}; it must be an integer or bigint"
        )
    ts_type = column_type("timestamp_column", policy.timestamp_column)
    if ts_type not in _TIMESTAMP_TYPES:
        raise PermanentError(
            f"{where}: field 'timestamp_column': column {policy.timestamp_column!r} is {ts_type};"
            " it must be timestamptz or timestamp"
        )
    tenant_type = column_type("tenant_column", policy.tenant_column) if policy.tenant_column else None

    indexes = dbapi.fetch_all(conn, _INDEXES_SQL, rel)
    if not any(unique and nkeys == 1 and cols == [policy.key_column] for unique, nkeys, cols in indexes):
        raise PermanentError(
            f"{where}: field 'key_column': column {policy.key_column!r} of {policy.table} has no unique index;"
            " the key must be unique and indexed (a primary key or a unique index on that column alone)"
        )
    warnings: list[str] = []
    leading = {cols[0] for _, _, cols in indexes if cols}
    if policy.timestamp_column not in leading:
        warnings.append(
            f"{where}: no index starts with {policy.timestamp_column!r} on {policy.table}: planning scans the"
            f" whole table; create one: CREATE INDEX CONCURRENTLY ON {policy.table.sql}"
            f" ({quote_ident(policy.timestamp_column)})"
        )
    if policy.tenant_column and not any(
        cols[:2] == [policy.tenant_column, policy.key_column] for _, _, cols in indexes
    ):
        warnings.append(
            f"{where}: no index on ({policy.tenant_column}, {policy.key_column}) on {policy.table}: chunk"
            " boundaries and batches of one tenant scan other tenants' rows; create one: CREATE INDEX"
            f" CONCURRENTLY ON {policy.table.sql} ({quote_ident(policy.tenant_column)},"
            f" {quote_ident(policy.key_column)})"
        )
    for message in warnings:
        log.warning("%s", message)

    if policy.archive_table is not None:
        if not _relation_exists(conn, policy.archive_table):
            raise PermanentError(f"{where}: field 'archive_table': table {policy.archive_table} does not exist")
        (same,) = dbapi.fetch_all(
            conn,
            "SELECT to_regclass(%(a)s) = to_regclass(%(t)s)",
            {"a": policy.archive_table.regclass_literal, "t": policy.table.regclass_literal},
        )[0]
        if same:
            raise PermanentError(
                f"{where}: field 'archive_table': {policy.archive_table} is the target table {policy.table}"
                " itself (through the search_path); rows would be deleted and re-inserted"
            )
        archive_cols = {
            name for name, _, _ in dbapi.fetch_all(conn, _COLUMNS_SQL, {"rel": policy.archive_table.regclass_literal})
        }
        lacking = [c for c in ordered if c not in archive_cols]
        if lacking:
            raise PermanentError(
                f"{where}: field 'archive_table': {policy.archive_table} lacks column(s) {', '.join(lacking)}"
                f" of {policy.table}"
            )

    info = TargetInfo(
        timestamp_has_tz=ts_type == "timestamp with time zone",
        tenant_type=tenant_type,
        columns=ordered,
        warnings=tuple(warnings),
    )
    if policy.condition:
        _check_condition(conn, policy)
    return info


def _check_condition(conn: Any, policy: RetentionPolicy) -> None:
    """Let the server parse the condition once, so a typo fails the run at once and not every batch."""
    from airflow_retention.core.sql import condition_probe

    try:
        dbapi.fetch_all(conn, condition_probe(policy), lock_timeout_ms=policy.lock_timeout_ms)
    except PermanentError as exc:
        raise PermanentError(f"policy {policy.name!r}: field 'condition' is not valid SQL here: {exc}") from exc
