"""Moving a detached partition into ``detached_schema`` under names that cannot clash.

``ALTER TABLE … SET SCHEMA`` moves the table with its indexes and the sequences it owns, and fails
(SQLSTATE 42P07, for good: every retry would fail the same way) when the schema already has a relation
or a type of one of those names. That happens in practice: pg_partman recreates a child of the same
name for late rows (``partition_data_time``), whose next detach meets the table an earlier run moved.
So each relation whose name is taken there is renamed first, in the same transaction, to the first free
``<name>_<n>`` (shortened to PostgreSQL's 63 bytes); names that are free are kept.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.identifiers import TableName, quote_ident

log = logging.getLogger(__name__)

# The relations SET SCHEMA moves: the table, its indexes, the sequences it owns (serial, identity).
MOVED_RELATIONS = """
SELECT c.relname::text, c.relkind::text FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass
UNION ALL
SELECT ic.relname::text, ic.relkind::text FROM pg_catalog.pg_index i
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid WHERE i.indrelid = %(rel)s::regclass
UNION ALL
SELECT sc.relname::text, sc.relkind::text FROM pg_catalog.pg_depend d
JOIN pg_catalog.pg_class sc ON sc.oid = d.objid AND sc.relkind = 'S'
WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.refclassid = 'pg_catalog.pg_class'::regclass
  AND d.refobjid = %(rel)s::regclass AND d.deptype IN ('a', 'i')
"""

# Names taken in a schema: relations, and types (a table's row type has the table's name).
TAKEN_NAMES = """
SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s
UNION
SELECT t.typname::text FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname = %(schema)s
"""

_ALTER = {"r": "TABLE", "p": "TABLE", "i": "INDEX", "I": "INDEX", "S": "SEQUENCE"}
_NAME_BYTES = 63


def free_name(name: str, taken: set[str]) -> str:
    """``name`` if it is not taken, else the first ``<name>_<n>`` (n = 1, 2, …) that is not, the name cut
    so that the whole fits PostgreSQL's 63 bytes."""
    if name not in taken:
        return name
    n = 1
    while True:
        suffix = f"_{n}"
        base = name.encode()[: _NAME_BYTES - len(suffix)].decode(errors="ignore")
        candidate = base + suffix
        if candidate not in taken:
            return candidate
        n += 1


def move_to_schema(cur: Any, table: TableName, schema: str) -> TableName:
    """Move ``table`` (with its indexes and sequences) into ``schema`` in the caller's transaction,
    renaming first whatever would clash there. Returns the table's new name."""
    cur.execute(MOVED_RELATIONS, {"rel": table.regclass_literal})
    moved = [(str(name), str(kind)) for name, kind in cur.fetchall()]
    cur.execute(TAKEN_NAMES, {"schema": schema})
    there = {str(r[0]) for r in cur.fetchall()}
    cur.execute(TAKEN_NAMES, {"schema": table.schema})
    # A new name must be free in both schemas: the rename happens here, the relation lives there.
    taken = there | {str(r[0]) for r in cur.fetchall()}
    new_table = table
    for name, kind in moved:
        if name not in there:
            continue
        new = free_name(name, taken)
        taken.add(new)
        cur.execute(
            f"ALTER {_ALTER[kind]} {quote_ident(table.schema)}.{quote_ident(name)} RENAME TO {quote_ident(new)}"
        )
        log.warning(
            "%s %s.%s: %s already has a relation or type of that name: renamed to %s before the move",
            _ALTER[kind].lower(),
            table.schema,
            name,
            schema,
            new,
        )
        if name == table.name:
            new_table = TableName(table.schema, new)
    cur.execute(f"ALTER TABLE {new_table.sql} SET SCHEMA {quote_ident(schema)}")
    return TableName(schema, new_table.name)
