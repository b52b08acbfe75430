"""Statements on the server's catalog: a relation's kind, size and statistics, privileges, schemas,
and the partition tree, a partition's state and its bounds.
"""

from __future__ import annotations

# The relation's kind: 'r' table, 'p' partitioned table, 'v' view, 'f' foreign table, 'm' materialized view.
RELATION_KIND = "SELECT c.relkind::text FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass"


# A plain table's inheritance children (CREATE TABLE ... INHERITS), by name: a statement on the parent
# reads and deletes their rows too, while its physical blocks are the parent's alone.
INHERITANCE_CHILDREN = (
    "SELECT i.inhrelid::regclass::text FROM pg_catalog.pg_inherits i WHERE i.inhparent = %(rel)s::regclass ORDER BY 1"
)

# The table's size in blocks now, the server's estimate of its rows (reltuples), the server's version.
BLOCK_COUNT = (
    "SELECT pg_relation_size(%(rel)s::regclass) / current_setting('block_size')::bigint,"
    " (SELECT reltuples FROM pg_catalog.pg_class WHERE oid = %(rel)s::regclass)::float8,"
    " current_setting('server_version_num')::integer"
)


# How the tenant column's values follow the table's physical order (pg_stats, after ANALYZE): near 0
# when every tenant's rows are spread over every block.
TENANT_CORRELATION = (
    "SELECT s.correlation FROM pg_catalog.pg_stats s"
    " JOIN pg_catalog.pg_class c ON c.relname = s.tablename"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace AND n.nspname = s.schemaname"
    " WHERE c.oid = %(rel)s::regclass AND s.attname = %(col)s"
)


# Privileges of the current role on a relation, by name: has it each table privilege, does it own it.
TABLE_PRIVILEGES = (
    "SELECT current_user::text, has_table_privilege(%(rel)s::regclass, 'SELECT'),"
    " has_table_privilege(%(rel)s::regclass, 'DELETE'), has_table_privilege(%(rel)s::regclass, 'INSERT'),"
    " pg_has_role(c.relowner, 'USAGE') FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass"
)


# Whether a schema exists and the current role may create tables in it.
SCHEMA_STATE = (
    "SELECT true, has_schema_privilege(n.oid, 'CREATE') FROM pg_catalog.pg_namespace n WHERE n.nspname = %(s)s"
)


# Every relation of a partitioned table's tree, pending detaches included (pg_partition_tree leaves
# them out): oid, parent oid, level, whether it or an ancestor is pending detach, kind, schema, name,
# its partition bound, its size in blocks and estimated rows (tables), and, for a partitioned one,
# its strategy and its key column (NULL for an expression or several columns).
PARTITION_TREE = """
WITH RECURSIVE tree AS (
    SELECT c.oid AS relid, NULL::oid AS parent, 0 AS level, false AS pending
    FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass
  UNION ALL
    SELECT i.inhrelid, i.inhparent, t.level + 1, t.pending OR i.inhdetachpending
    FROM pg_catalog.pg_inherits i JOIN tree t ON i.inhparent = t.relid
)
SELECT t.relid::bigint, t.parent::bigint, t.level, t.pending, c.relkind::text, n.nspname::text, c.relname::text,
       pg_catalog.pg_get_expr(c.relpartbound, c.oid),
       CASE WHEN c.relkind = 'r' THEN pg_catalog.pg_relation_size(c.oid) / current_setting('block_size')::bigint END,
       c.reltuples::float8,
       p.partstrat::text,
       (SELECT a.attname::text FROM pg_catalog.pg_attribute a
        WHERE a.attrelid = p.partrelid AND p.partnatts = 1 AND a.attnum = p.partattrs[0])
FROM tree t
JOIN pg_catalog.pg_class c ON c.oid = t.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_partitioned_table p ON p.partrelid = t.relid
ORDER BY t.level, n.nspname, c.relname
"""


# A partition as it is now, by the oid recorded at planning: schema, name, its parent's oid, schema and
# name, whether the detach from that parent is pending, whether the parent has a DEFAULT partition, and
# whether the partition still belongs to the policy's table (``%(root)s``). No row: it was dropped.
PARTITION_STATE = """
SELECT n.nspname::text, c.relname::text, i.inhparent::bigint, pn.nspname::text, pc.relname::text,
       coalesce(i.inhdetachpending, false),
       coalesce((SELECT p.partdefid <> 0 FROM pg_catalog.pg_partitioned_table p WHERE p.partrelid = i.inhparent),
                false),
       i.inhparent IS NOT NULL AND (i.inhparent = %(root)s::regclass
           OR i.inhparent IN (SELECT relid FROM pg_catalog.pg_partition_tree(%(root)s::regclass)))
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_inherits i ON i.inhrelid = c.oid
LEFT JOIN pg_catalog.pg_class pc ON pc.oid = i.inhparent
LEFT JOIN pg_catalog.pg_namespace pn ON pn.oid = pc.relnamespace
WHERE c.oid = %(oid)s::oid
"""


# The RANGE bounds that can prove a partition (``%(oid)s``) expired by time: its own bound and each of
# its ancestors' below the policy's table (``%(root)s``), with the strategy and the single key column
# (NULL for an expression or several columns) of the parent each bound belongs to, nearest first.
PARTITION_BOUNDS = """
WITH RECURSIVE up AS (
    SELECT %(oid)s::oid AS relid, 0 AS depth
  UNION ALL
    SELECT i.inhparent, up.depth + 1 FROM up JOIN pg_catalog.pg_inherits i ON i.inhrelid = up.relid
    WHERE up.relid <> %(root)s::regclass
)
SELECT pg_catalog.pg_get_expr(c.relpartbound, c.oid), p.partstrat::text,
       (SELECT a.attname::text FROM pg_catalog.pg_attribute a
        WHERE a.attrelid = p.partrelid AND p.partnatts = 1 AND a.attnum = p.partattrs[0])
FROM up
JOIN pg_catalog.pg_class c ON c.oid = up.relid
JOIN pg_catalog.pg_inherits i ON i.inhrelid = up.relid
JOIN pg_catalog.pg_partitioned_table p ON p.partrelid = i.inhparent
WHERE up.relid <> %(root)s::regclass
ORDER BY up.depth
"""


# Each leaf of the target (the table itself when it is not partitioned) with the name of a btree index
# the probe of an empty run can walk: valid, not partial, its first column the timestamp column (NULL:
# none). A foreign leaf has none.
TIMESTAMP_INDEXES = """
SELECT l.relid::bigint,
       (SELECT ic.relname::text
        FROM pg_catalog.pg_index i
        JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
        JOIN pg_catalog.pg_am am ON am.oid = ic.relam
        JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
        WHERE i.indrelid = l.relid AND am.amname = 'btree' AND i.indisvalid AND i.indisready AND i.indislive
          AND i.indpred IS NULL AND a.attname = %(col)s
        ORDER BY ic.relname LIMIT 1)
FROM (SELECT t.relid FROM pg_catalog.pg_partition_tree(%(rel)s::regclass) t WHERE t.isleaf
      UNION ALL
      SELECT c.oid FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass AND c.relkind <> 'p') l
ORDER BY 1
"""
