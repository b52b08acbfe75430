"""What the catalog says about a policy's target table, checked once before any delete."""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError, TableMissing
from airflow_retention.core.policy.identifiers import TableName, display_name, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import INHERITANCE_CHILDREN, RELATION_KIND, SCHEMA_STATE, TABLE_PRIVILEGES
from airflow_retention.core.sql.predicate import condition_probe
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)

_INTEGER_TYPES = {"smallint", "integer", "bigint"}
_TIMESTAMP_TYPES = {"timestamp with time zone", "timestamp without time zone"}

# Each column's type twice: without its modifier, to check what kind of type it is ("character", "timestamp
# with time zone" whatever its length or precision), and exactly as declared, to cast values to it
# ("character(4)": format_type(atttypid, NULL) would give "character", which a cast reads as char(1)).
_COLUMNS_SQL = """
SELECT a.attname, format_type(a.atttypid, NULL), a.attnum, format_type(a.atttypid, a.atttypmod)
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = %(rel)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

# A column's type down to the base of its domains (domains over domains included): its schema-qualified
# name, which casts read without a modifier, and its category ('A': an array).
_BASE_TYPE_SQL = """
WITH RECURSIVE d AS (
    SELECT t.oid, t.typbasetype FROM pg_catalog.pg_type t
    JOIN pg_catalog.pg_attribute a ON a.atttypid = t.oid
    WHERE a.attrelid = %(rel)s::regclass AND a.attname = %(col)s
  UNION ALL
    SELECT t.oid, t.typbasetype FROM pg_catalog.pg_type t JOIN d ON t.oid = d.typbasetype
)
SELECT format('%%I.%%I', n.nspname, t.typname), t.typcategory::text
FROM d JOIN pg_catalog.pg_type t ON t.oid = d.oid JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
WHERE d.typbasetype = 0
"""

# A column's collation, schema-qualified and quoted; NULL for a type that has none.
_COLLATION_SQL = """
SELECT format('%%I.%%I', n.nspname, c.collname)
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_collation c ON c.oid = a.attcollation
JOIN pg_catalog.pg_namespace n ON n.oid = c.collnamespace
WHERE a.attrelid = %(rel)s::regclass AND a.attname = %(col)s
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


_KINDS = {"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence", "i": "an index"}


def require_privileges(conn: Any, policy: RetentionPolicy, relation: TableName, needed: tuple[str, ...]) -> None:
    """Fail at once, before anything is deleted, when this role lacks a privilege a statement on
    ``relation`` will need: ``SELECT``, ``DELETE``, ``INSERT`` or ``ownership`` (DETACH and DROP need it).
    The message names the privilege and the relation, as a DBA would grant it."""
    rows = dbapi.fetch_all(conn, TABLE_PRIVILEGES, {"rel": relation.regclass_literal})
    if not rows:
        return
    user, can_select, can_delete, can_insert, owns = rows[0]
    have = {"SELECT": can_select, "DELETE": can_delete, "INSERT": can_insert, "ownership": owns}
    lacking = [p for p in needed if not have[p]]
    if lacking:
        what = f"{' and '.join(lacking)} on {relation}"
        grant = [p for p in lacking if p != "ownership"]
        hint = f"GRANT {', '.join(grant)} ON {relation.sql} TO {quote_ident(user)}" if grant else ""
        if "ownership" in lacking:
            hint += ("; " if hint else "") + f"ALTER TABLE {relation.sql} OWNER TO a role {user} is a member of"
        raise PermanentError(
            f"policy {policy.name!r}: insufficient privilege: role {user} lacks {what} ({hint}); nothing was deleted"
        )


def _refuse_inheritance(conn: Any, policy: RetentionPolicy) -> None:
    """A plain table with inheritance children is refused: a statement on it also reads and deletes the
    children's rows, so block chunks (TID ranges of the parent's blocks alone) would cover the children
    only where their block numbers happen to fall inside the parent's, and a key's uniqueness holds only
    per table. A policy per child (and ``ONLY`` semantics for the parent) is what a DBA can reason about."""
    children = [c for (c,) in dbapi.fetch_all(conn, INHERITANCE_CHILDREN, {"rel": policy.table.regclass_literal})]
    if children:
        raise PermanentError(
            f"policy {policy.name!r}: field 'table': {policy.table} has {len(children)} inheritance child"
            f" table(s) ({', '.join(children[:5])}{' …' if len(children) > 5 else ''}): a statement on it reaches"
            " their rows too, which its chunks cannot cover; give each child table a policy of its own (and"
            " the parent too, once it has no children), or make it a partitioned table; nothing was deleted"
        )


def _relation_exists(conn: Any, table: TableName) -> bool:
    rows = dbapi.fetch_all(conn, "SELECT to_regclass(%(rel)s) IS NOT NULL", {"rel": table.regclass_literal})
    return bool(rows[0][0])


def inspect_target(conn: Any, policy: RetentionPolicy, *, quiet: bool = False, privileges: bool = True) -> TargetInfo:
    """Check the table, its columns, types and indexes against the policy; raise :class:`PermanentError`
    naming what is wrong, and log a warning for each missing index that will make the purge slow.

    :param quiet: check only, without the index warnings (the status command and the view probe every
        policy's target on each look).
    :param privileges: check the role's privileges on the table (and the archive table); off when the
        connection is not the purge role's (``airflow-retention status --dsn``)."""
    where = f"policy {policy.name!r}"
    if not _relation_exists(conn, policy.table):
        (database,) = dbapi.fetch_all(conn, "SELECT current_database()")[0]
        raise TableMissing(where, policy.table, policy.conn_id, database)
    rel = {"rel": policy.table.regclass_literal}
    (kind,) = dbapi.fetch_all(conn, RELATION_KIND, rel)[0]
    if kind not in ("r", "p"):
        raise PermanentError(
            f"{where}: field 'table': {policy.table} is {_KINDS.get(kind, f'a relation of kind {kind!r}')};"
            " a policy purges a table or a partitioned table"
        )
    partitioned = kind == "p"
    if not partitioned:
        _refuse_inheritance(conn, policy)
    if partitioned and policy.chunk_by == "key":
        raise PermanentError(
            f"{where}: field 'chunk_by': {policy.table} is a partitioned table; key chunks need a unique index on"
            " the key alone, which a partitioned table cannot have: use chunk_by 'block' (chunks per partition)"
        )
    described = dbapi.fetch_all(conn, _COLUMNS_SQL, rel)
    columns = {name: typ for name, typ, _, _ in described}
    declared = {name: typ for name, _, _, typ in described}
    ordered = tuple(name for name, _, _, _ in described)

    def column_type(field_name: str, column: str) -> str:
        if column not in columns:
            raise PermanentError(
                f"{where}: field {field_name!r}: column {display_name(column)} does not exist in {policy.table}"
                f" (columns: {', '.join(display_name(c) for c in ordered)})"
            )
        return columns[column]

    by_key = policy.chunk_by == "key"
    key_type = column_type("key_column", policy.key_column) if policy.key_column is not None else None
    if by_key and key_type not in _INTEGER_TYPES:
        raise PermanentError(
            f"{where}: field 'key_column': column {display_name(str(policy.key_column))} is {key_type}; chunk_by"
            " 'key' needs an integer or bigint key: use chunk_by 'block', which needs no key (uuid, text,"
            " composite or no key at all)"
        )
    ts_type = column_type("timestamp_column", policy.timestamp_column)
    if ts_type not in _TIMESTAMP_TYPES:
        raise PermanentError(
            f"{where}: field 'timestamp_column': column {policy.timestamp_column!r} is {ts_type};"
            " it must be timestamptz or timestamp"
        )
    tenant_type, tenant_base, tenant_collation = None, None, None
    if policy.tenant_column:
        column_type("tenant_column", policy.tenant_column)
        tenant_type = declared[policy.tenant_column]
        tenant_base, category = dbapi.fetch_all(conn, _BASE_TYPE_SQL, {**rel, "col": policy.tenant_column})[0]
        if category == "A":
            raise PermanentError(
                f"{where}: field 'tenant_column': column {display_name(policy.tenant_column)} is {tenant_type},"
                " an array; a tenant is one value (text, a number, a uuid, an enum...)"
            )
        collation = dbapi.fetch_all(conn, _COLLATION_SQL, {**rel, "col": policy.tenant_column})
        tenant_collation = collation[0][0] if collation else None

    indexes = dbapi.fetch_all(conn, _INDEXES_SQL, rel)
    if by_key and not any(unique and nkeys == 1 and cols == [policy.key_column] for unique, nkeys, cols in indexes):
        raise PermanentError(
            f"{where}: field 'key_column': column {display_name(str(policy.key_column))} of {policy.table} has no"
            " unique index; with chunk_by 'key' the key must be unique and indexed (a primary key or a unique"
            " index on that column alone); chunk_by 'block' needs no key"
        )
    warnings: list[str] = []
    leading = {cols[0] for _, _, cols in indexes if cols}
    if policy.timestamp_column not in leading:
        warnings.append(
            f"{where}: no index starts with {policy.timestamp_column!r} on {policy.table}: planning scans the"
            f" whole table; create one: CREATE INDEX CONCURRENTLY ON {policy.table.sql}"
            f" ({quote_ident(policy.timestamp_column)})"
        )
    if (
        by_key
        and policy.tenant_column
        and not any(cols[:2] == [policy.tenant_column, policy.key_column] for _, _, cols in indexes)
    ):
        warnings.append(
            f"{where}: no index on ({display_name(policy.tenant_column)}, {display_name(str(policy.key_column))})"
            f" on {policy.table}: chunk"
            " boundaries and batches of one tenant scan other tenants' rows; create one: CREATE INDEX"
            f" CONCURRENTLY ON {policy.table.sql} ({quote_ident(policy.tenant_column)},"
            f" {quote_ident(str(policy.key_column))})"
        )
    for message in warnings if not quiet else ():
        log.warning("%s", message)

    if policy.archive_table is not None:
        if not _relation_exists(conn, policy.archive_table):
            raise PermanentError(f"{where}: field 'archive_table': table {policy.archive_table} does not exist")
        _check_archive_persistence(conn, policy)
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
            name for name, *_ in dbapi.fetch_all(conn, _COLUMNS_SQL, {"rel": policy.archive_table.regclass_literal})
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
        partitioned=partitioned,
        wal_compression=batch_wal_compression(conn, policy),
        tenant_base_type=tenant_base,
        tenant_collation=tenant_collation,
    )
    # A partitioned table's leaves are checked by the planner (core/planning/partitions.py): rows are deleted there.
    if privileges:
        require_privileges(conn, policy, policy.table, ("SELECT",) if policy.dry_run else ("SELECT", "DELETE"))
        if policy.archive_table is not None and not policy.dry_run:
            require_privileges(conn, policy, policy.archive_table, ("INSERT",))
    if policy.condition:
        _check_condition(conn, policy)
    return info


# An archive that a crash or the end of a session empties: the rows would be gone from both tables.
_NOT_DURABLE = {"u": "UNLOGGED (a crash or an immediate shutdown empties it)", "t": "TEMPORARY (its session's own)"}


def _check_archive_persistence(conn: Any, policy: RetentionPolicy) -> None:
    """Refuse an archive table that does not keep its rows as durably as the deletions that fill it: the
    source rows are deleted for good at commit, so the archive must survive a crash too."""
    assert policy.archive_table is not None
    (persistence,) = dbapi.fetch_all(
        conn,
        "SELECT c.relpersistence::text FROM pg_catalog.pg_class c WHERE c.oid = %(a)s::regclass",
        {"a": policy.archive_table.regclass_literal},
    )[0]
    if persistence in _NOT_DURABLE:
        raise PermanentError(
            f"policy {policy.name!r}: field 'archive_table': {policy.archive_table} is {_NOT_DURABLE[persistence]};"
            " the deleted rows would be lost with it while their deletion stays: make it a logged table"
            f" (ALTER TABLE {policy.archive_table.sql} SET LOGGED); nothing was deleted"
        )


def check_detached_schema(conn: Any, policy: RetentionPolicy) -> None:
    """``detached_schema`` must exist and take new tables from this role, before anything is detached."""
    if policy.detached_schema is None:
        return
    rows = dbapi.fetch_all(conn, SCHEMA_STATE, {"s": policy.detached_schema})
    if not rows:
        raise PermanentError(
            f"policy {policy.name!r}: field 'detached_schema': schema {display_name(policy.detached_schema)} does"
            " not exist; create it (CREATE SCHEMA) or leave detached_schema out; nothing was detached"
        )
    if not rows[0][1]:
        raise PermanentError(
            f"policy {policy.name!r}: field 'detached_schema': insufficient privilege: this role lacks CREATE on"
            f" schema {display_name(policy.detached_schema)} (GRANT CREATE ON SCHEMA"
            f" {quote_ident(policy.detached_schema)} TO …); nothing was detached"
        )


# The value "auto" picks: the fastest of the compressing methods (docs/performance.md has its numbers).
AUTO_WAL_COMPRESSION = "lz4"
# Why a value cannot be set: the role may not (42501), the server does not know it (22023).
_CANNOT_SET = {"42501": "privilege", "22023": "value"}


def batch_wal_compression(conn: Any, policy: RetentionPolicy) -> str | None:
    """The ``wal_compression`` every batch transaction sets (``SET LOCAL``), or None for the server's.

    Tried once here in a transaction of its own (``set_config(..., true)`` lasts until its end). With
    ``"auto"`` a role that may not set it, or a server without lz4, leaves the server's setting (logged);
    an explicit value that cannot be set fails the policy, naming the field and the grant."""
    wanted = AUTO_WAL_COMPRESSION if policy.wal_compression == "auto" else policy.wal_compression
    if wanted == "server":
        return None
    try:
        user, current = dbapi.fetch_all(
            conn,
            "SELECT current_user::text, current_setting('wal_compression'), set_config('wal_compression', %(v)s, true)",
            {"v": wanted},
        )[0][:2]
    except PermanentError as exc:
        reason = _CANNOT_SET.get(dbapi.sqlstate(exc.__cause__) or "")
        if reason is None:
            raise
        (user,) = dbapi.fetch_all(conn, "SELECT current_user::text")[0]
        why = (
            f"role {user} may not set wal_compression (a superuser may, or: GRANT SET ON PARAMETER"
            f" wal_compression TO {quote_ident(user)}, PostgreSQL 15+)"
            if reason == "privilege"
            else f"the server does not accept wal_compression = {wanted} (lz4 and zstd need PostgreSQL 15+"
            " built with them)"
        )
        if policy.wal_compression != "auto":
            raise PermanentError(
                f"policy {policy.name!r}: field 'wal_compression': {why}; set it to 'auto' or 'server', or"
                " fix the grant; nothing was deleted"
            ) from exc
        log.info(
            "policy %s: wal_compression auto: batches write full-page images as the server's setting says: %s",
            policy.name,
            why,
        )
        return None
    if current == wanted:
        return None  # the server's setting already
    log.info("policy %s: batches set wal_compression = %s (the server's setting: %s)", policy.name, wanted, current)
    return wanted


def _check_condition(conn: Any, policy: RetentionPolicy) -> None:
    """Let the server parse the condition once, so a typo fails the run at once and not every batch."""
    try:
        dbapi.fetch_all(conn, condition_probe(policy), lock_timeout_ms=policy.lock_timeout_ms)
    except PermanentError as exc:
        raise PermanentError(f"policy {policy.name!r}: field 'condition' is not valid SQL here: {exc}") from exc
