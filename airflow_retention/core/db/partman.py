"""pg_partman beside the package: what a partition action must do so that partman's maintenance keeps
running, and what it must refuse.

pg_partman keeps one row in ``part_config`` per partitioned relation it manages: the set's parent and,
in a sub-partitioned set, every sub-parent (a month split into days); ``part_config_sub`` hangs off it
(foreign key, ``ON DELETE CASCADE``). partman's own retention deletes a removed sub-parent's row; a
relation removed by anyone else leaves it behind, and the next ``run_maintenance()`` fails on every
table ("Given parent table not found in system catalogs"). So a chunk that drops a partition, or
detaches it out of the set, deletes the rows of that relation and of every partitioned relation below
it, in the same transaction as the drop or the move (:func:`forget`). The planner checks the grant
first (:func:`check_plan`).

A partition detached under its own name in its own schema is still where partman looks for the child of
that range: ``partition_data_time`` would move late rows of the DEFAULT partition into it (out of the
live table). With ``expired_partitions: detach`` on a set partman manages, ``detached_schema`` is
required.

Nothing here runs when the extension is not installed in the target database.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.identifiers import TableName, display_name, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)

PARTMAN_SCHEMA = """
SELECT n.nspname::text FROM pg_catalog.pg_extension e
JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
WHERE e.extname = 'pg_partman'
"""

# A relation and every partitioned relation below it, named as part_config names them ("schema.table",
# unquoted). A plain table that is no partition has no tree: its own name only.
PARTITIONED_NAMES = """
SELECT n.nspname::text || '.' || c.relname::text
FROM pg_catalog.pg_partition_tree(%(rel)s::regclass) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'p'
"""


READABLE = """
SELECT current_user::text, has_schema_privilege(%(schema)s, 'USAGE')
    AND has_table_privilege(%(part_config)s, 'SELECT')
"""


def installed(conn_or_cur: Any) -> str | None:
    """The schema pg_partman is installed in, or None when the database has no pg_partman."""
    rows = _fetch(conn_or_cur, PARTMAN_SCHEMA, {})
    return str(rows[0][0]) if rows else None


def readable(conn_or_cur: Any, schema: str) -> tuple[str, bool]:
    """This role's name, and whether it may read partman's ``part_config`` (USAGE on the schema, SELECT)."""
    rows = _fetch(conn_or_cur, READABLE, {"schema": schema, "part_config": TableName(schema, "part_config").sql})
    return str(rows[0][0]), bool(rows[0][1])


def partitioned_names(conn_or_cur: Any, relation: TableName) -> list[str]:
    """``relation`` and the partitioned relations below it, as ``part_config.parent_table`` spells them."""
    return [str(r[0]) for r in _fetch(conn_or_cur, PARTITIONED_NAMES, {"rel": relation.regclass_literal})]


def managed(conn_or_cur: Any, schema: str, names: list[str]) -> list[str]:
    """Which of ``names`` partman manages (rows of ``part_config``)."""
    if not names:
        return []
    sql = f"SELECT parent_table FROM {quote_ident(schema)}.part_config WHERE parent_table = ANY(%(names)s::text[])"
    return sorted(str(r[0]) for r in _fetch(conn_or_cur, sql, {"names": names}))


def _manages_table(conn: Any, schema: str, policy: RetentionPolicy) -> bool:
    """Whether partman manages the policy's table (or a partitioned relation below it)."""
    names = partitioned_names(conn, policy.table) or [f"{policy.table.schema}.{policy.table.name}"]
    return bool(managed(conn, schema, names))


def check_plan(conn: Any, policy: RetentionPolicy, removed: list[TableName]) -> None:
    """At planning, before anything is removed: refuse a detach that partman would undo, and check that
    this role may read and delete partman's rows of the partitioned relations the plan removes whole
    (``removed``). A role that may not read ``part_config`` is checked only where it matters: a plan
    that removes a partitioned relation (only those can be partman's) is refused, naming the grants.

    :raises PermanentError: naming the field or the grant."""
    schema = installed(conn)
    if schema is None:
        return
    user, can_read = readable(conn, schema)
    below = [name for table in removed for name in partitioned_names(conn, table)]
    part_config = TableName(schema, "part_config")
    if not can_read:
        if below and not policy.dry_run:
            raise PermanentError(
                f"policy {policy.name!r}: insufficient privilege: role {user} cannot read {part_config} (pg_partman's"
                f" configuration), and this run removes partitioned relation(s) whole ({', '.join(below[:3])}"
                f"{', …' if len(below) > 3 else ''}) whose configuration there must go with them (GRANT USAGE ON"
                f" SCHEMA {quote_ident(schema)} TO {quote_ident(user)}; GRANT SELECT, DELETE ON {part_config.sql},"
                f" {TableName(schema, 'part_config_sub').sql} TO {quote_ident(user)}); nothing was deleted"
            )
        if policy.expired_partitions == "detach":
            log.warning(
                "policy %s: pg_partman is installed, and role %s cannot read %s: whether partman manages %s is not"
                " checked (a detach without detached_schema on a partman set lets partman fill the detached table;"
                " docs/partman.md)",
                policy.name,
                user,
                part_config,
                policy.table,
            )
        return
    if not _manages_table(conn, schema, policy):
        return
    check_detach(policy, schema)
    if policy.dry_run or not managed(conn, schema, below):
        return
    rows = _fetch(conn, "SELECT has_table_privilege(%(rel)s, 'DELETE')", {"rel": part_config.sql})
    if not rows[0][0]:
        raise PermanentError(
            f"policy {policy.name!r}: insufficient privilege: role {user} lacks DELETE on {part_config}, which holds"
            f" pg_partman's configuration of the sub-partitioned partition(s) this run removes; partman's"
            f" maintenance fails on every table while a removed one is still configured (GRANT DELETE ON"
            f" {part_config.sql} TO {quote_ident(user)}); nothing was deleted"
        )


def check_detach(policy: RetentionPolicy, schema: str) -> None:
    """On a set partman manages, a detached partition must leave the set's schema: refuse otherwise."""
    if policy.expired_partitions != "detach":
        return
    if policy.detached_schema is not None and policy.detached_schema != policy.table.schema:
        return
    raise PermanentError(
        f"policy {policy.name!r}: field 'detached_schema': pg_partman manages {policy.table}"
        f" ({display_name(schema)}.part_config), and a partition detached under its own name in its own schema"
        " stays where partman looks for the child of its range: partman's partition_data_time would move late"
        " rows of the DEFAULT partition into it, out of the live table. Set detached_schema (a schema of its"
        " own, e.g. retention_detached) or use expired_partitions: drop; nothing was detached (docs/partman.md)"
    )


def check_chunk(conn: Any, policy: RetentionPolicy) -> None:
    """When a partition chunk runs (its policy may have changed since planning): the same refusal of a
    detach partman would undo, before anything is detached. Silent where part_config cannot be read."""
    if policy.expired_partitions != "detach" or policy.dry_run:
        return
    schema = installed(conn)
    if schema is None or not readable(conn, schema)[1]:
        return
    if _manages_table(conn, schema, policy):
        check_detach(policy, schema)


def forget(cur: Any, relation: TableName) -> list[str]:
    """In the transaction that drops ``relation`` or moves it out of its schema, before doing so: delete
    partman's configuration of it and of the partitioned relations below it (``part_config_sub`` follows
    by its foreign key), as partman's own retention does. Only rows partman has are touched (the planner
    checked the grants for those); a role that cannot read ``part_config`` removed no partitioned
    relation partman has (the planner refused). Returns the names forgotten."""
    schema = installed(cur)
    if schema is None or not readable(cur, schema)[1]:
        return []
    names = managed(cur, schema, partitioned_names(cur, relation))
    if not names:
        return []
    cur.execute(
        f"DELETE FROM {quote_ident(schema)}.part_config WHERE parent_table = ANY(%(names)s::text[])"
        " RETURNING parent_table",
        {"names": names},
    )
    forgotten = sorted(str(r[0]) for r in cur.fetchall())
    if forgotten:
        log.info(
            "pg_partman: removed %s from %s.part_config with the partition (partman's retention does the same)",
            ", ".join(forgotten),
            schema,
        )
    return forgotten


def _fetch(conn_or_cur: Any, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    if hasattr(conn_or_cur, "execute") and hasattr(conn_or_cur, "fetchall"):
        conn_or_cur.execute(sql, params)
        return list(conn_or_cur.fetchall())
    return dbapi.fetch_all(conn_or_cur, sql, params)
