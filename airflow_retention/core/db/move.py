"""Moving a detached partition into ``detached_schema`` under names that cannot clash.

``ALTER TABLE … SET SCHEMA`` moves a table with its indexes, the sequences it owns and its row type
(and that type's array type), but not its own partitions: a detached month of days is moved relation by
relation, so that none of it stays where pg_partman looks for it. A move fails (SQLSTATE 42P07, for
good: every retry would fail the same way) when the schema already has a relation or a type of one of
those names. That happens in practice: pg_partman recreates a child of the same name for late rows
(``partition_data_time``), whose next detach meets the table an earlier run moved. So each relation
whose name (or whose row type's array type name) is taken there is renamed first, in the same
transaction, to the first free ``<name>_<n>`` (cut to PostgreSQL's 63 bytes); free names are kept.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.policy.identifiers import TableName, quote_ident

log = logging.getLogger(__name__)

# The relation and, when it is partitioned, every partition below it; with each, what SET SCHEMA moves
# along: its indexes and the sequences it owns. Columns: schema, name, kind, the row type's array type
# name (tables only), whether it is one of the tables to move.
MOVED_RELATIONS = """
WITH tree AS (
    SELECT relid AS oid FROM pg_catalog.pg_partition_tree(%(rel)s::regclass)
    UNION SELECT %(rel)s::regclass::oid
)
SELECT n.nspname::text, c.relname::text, c.relkind::text, at.typname::text, true
FROM tree JOIN pg_catalog.pg_class c ON c.oid = tree.oid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_type rt ON rt.oid = c.reltype
LEFT JOIN pg_catalog.pg_type at ON at.oid = rt.typarray
UNION ALL
SELECT n.nspname::text, ic.relname::text, ic.relkind::text, NULL, false
FROM tree JOIN pg_catalog.pg_index i ON i.indrelid = tree.oid
JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
JOIN pg_catalog.pg_namespace n ON n.oid = ic.relnamespace
UNION ALL
SELECT n.nspname::text, sc.relname::text, sc.relkind::text, NULL, false
FROM tree JOIN pg_catalog.pg_depend d ON d.refobjid = tree.oid
    AND d.classid = 'pg_catalog.pg_class'::regclass AND d.refclassid = 'pg_catalog.pg_class'::regclass
    AND d.deptype IN ('a', 'i')
JOIN pg_catalog.pg_class sc ON sc.oid = d.objid AND sc.relkind = 'S'
JOIN pg_catalog.pg_namespace n ON n.oid = sc.relnamespace
"""

# Names taken in the given schemas: relations, and types (a table's row type has the table's name).
TAKEN_NAMES = """
SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = ANY(%(schemas)s::text[])
UNION
SELECT n.nspname::text, t.typname::text FROM pg_catalog.pg_type t
JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = ANY(%(schemas)s::text[])
"""

_ALTER = {"r": "TABLE", "p": "TABLE", "f": "FOREIGN TABLE", "i": "INDEX", "I": "INDEX", "S": "SEQUENCE"}
_NAME_BYTES = 63


def free_name(name: str, taken: set[str], *, array: bool = False) -> str:
    """``name`` if it is not taken, else the first ``<name>_<n>`` (n = 1, 2, …) that is not, the name cut
    so that the whole fits PostgreSQL's 63 bytes. ``array``: the row type's array type, ``_<name>``,
    must be free too."""

    def free(candidate: str) -> bool:
        return candidate not in taken and not (array and f"_{candidate}" in taken)

    if free(name):
        return name
    n = 1
    while True:
        suffix = f"_{n}"
        candidate = name.encode()[: _NAME_BYTES - len(suffix)].decode(errors="ignore") + suffix
        if free(candidate):
            return candidate
        n += 1


def move_to_schema(cur: Any, table: TableName, schema: str) -> TableName:
    """Move ``table`` and its partitions (with their indexes and sequences) into ``schema`` in the
    caller's transaction, renaming first whatever would clash there. Returns the table's new name."""
    cur.execute(MOVED_RELATIONS, {"rel": table.regclass_literal})
    moved = [(str(s), str(n), str(k), a, bool(t)) for s, n, k, a, t in cur.fetchall() if str(s) != schema]
    schemas = sorted({s for s, *_ in moved} | {schema})
    cur.execute(TAKEN_NAMES, {"schemas": schemas})
    names = [(str(s), str(n)) for s, n in cur.fetchall()]
    there = {n for s, n in names if s == schema}
    # A new name must be free in every schema involved: the rename happens in the relation's own schema,
    # and it lives in the target schema afterwards.
    taken = {n for _, n in names}
    placed: set[str] = set()  # names the moved relations will have in the target schema
    new_table = table
    tables: list[tuple[str, str, str]] = []
    for source, name, kind, array, is_table in moved:
        clash = name in there or name in placed or (array is not None and str(array) in there)
        new = free_name(name, taken | placed, array=is_table) if clash else name
        if new != name:
            cur.execute(f"ALTER {_ALTER[kind]} {quote_ident(source)}.{quote_ident(name)} RENAME TO {quote_ident(new)}")
            log.warning(
                "%s %s.%s: %s already has a relation or type of that name: renamed to %s before the move",
                _ALTER[kind].lower(),
                source,
                name,
                schema,
                new,
            )
        taken.add(new)
        placed.add(new)
        if is_table:
            placed.add(f"_{new}")
            tables.append((source, new, kind))
        if is_table and source == table.schema and name == table.name:
            new_table = TableName(schema, new)
    for source, name, kind in tables:
        cur.execute(f"ALTER {_ALTER[kind]} {quote_ident(source)}.{quote_ident(name)} SET SCHEMA {quote_ident(schema)}")
    return new_table
