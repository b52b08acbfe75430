"""Every statement that reads or deletes rows of a policy's target table, built in one place.

Identifiers are quoted by :mod:`identifiers`; values travel as parameters with explicit casts; the
policy's ``condition`` (trusted SQL) is wrapped in parentheses on lines of its own. Every statement
names the target through :func:`target_from`, under the alias of the policy table's own name, so that
the condition's ``events.col`` is the row at hand on the table and on each of its leaf partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules
from airflow_retention.core.sql.target import TargetInfo

# The whole key space, for statements that are not limited to a chunk. Not -2**63: psycopg2 sends
# -9223372036854775808::bigint, which overflows before the negation.
MIN_KEY = -(2**63) + 1
MAX_KEY = 2**63 - 1


def target_from(policy: RetentionPolicy, relation: TableName | None = None) -> str:
    """The target of a statement that reads or deletes the policy's rows: the table (or ``relation``, a
    leaf partition) under the alias of the policy table's unqualified name (``"public"."events_p3" AS
    "events"``). A ``condition`` may then write ``events.col`` for the row being deleted: a correlated
    subquery binds to it, on a plain table and on every leaf alike (a leaf's own name would be unknown
    to the condition). The one place the alias is made: every statement here goes through it."""
    return f"{(relation or policy.table).sql} AS {quote_ident(policy.table.name)}"


def eligibility(
    policy: RetentionPolicy,
    target: TargetInfo,
    *,
    tenant_filter: bool,
    null_tenants: bool = False,
    key_range: bool = True,
) -> str:
    """The predicate of an eligible row in the range ``[%(lo)s, %(hi)s)``, optionally of one tenant.

    Parameters: ``lo``, ``hi`` (bigint), ``cutoff`` (timestamptz), ``tenant`` (text) when filtered.
    A ``timestamp without time zone`` column is read as UTC. In a policy with a tenant column, a row
    whose tenant is NULL belongs to no tenant and is never eligible (``null_tenants`` lets the planner
    count them, to warn). ``key_range=False`` leaves out the range (block chunks bound rows by ``ctid``).
    """
    ts = quote_ident(policy.timestamp_column)
    parts = []
    if key_range:
        key = _key(policy)
        parts += [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"]
    if has_per_tenant_rules(policy):
        parts += _per_tenant(policy, target)
    else:
        parts.append(f"{ts} < {cutoff_value(target)}")
    if tenant_filter:
        parts.append(_one_tenant(policy, target))
    elif policy.tenant_column is not None and not null_tenants:
        parts.append(f"{quote_ident(policy.tenant_column)} IS NOT NULL")
    if policy.condition:
        # Statements built here always travel with parameters: a literal % (LIKE 'a%') must be doubled.
        parts.append(f"(\n{policy.condition.replace('%', '%%')}\n)")
    return "\n  AND ".join(parts)


def cutoff_value(target: TargetInfo, value: str = "%(cutoff)s::timestamptz") -> str:
    """The ``%(cutoff)s`` parameter (or another timestamptz expression) as a value of the timestamp
    column's type (a naive column is UTC)."""
    return value if target.timestamp_has_tz else f"({value} AT TIME ZONE 'UTC')"


def _per_tenant(policy: RetentionPolicy, target: TargetInfo) -> list[str]:
    """Each row against its own tenant's frozen cutoff (``%(ot)s`` tenants, ``%(oc)s`` their cutoffs,
    ``%(cutoff)s`` for every other tenant), bounded by ``%(latest_cutoff)s`` so that an index on the
    timestamp still serves; tenants in ``%(xt)s`` (at their ``max_rows_per_tenant``) are left out.
    Parameters from :meth:`airflow_retention.core.planning.tenants.TenantCutoffs.params`."""
    ts = quote_ident(policy.timestamp_column)
    tenant = quote_ident(str(policy.tenant_column))
    # The tenant lists are cast once to the column's type (folded by the server), so that each row is
    # compared as it is stored instead of paying a text cast of its tenant. The type carries its
    # modifier (character(4), not character, which is char(1) and would cut 'acme' to 'a'), and every
    # value was checked to fit it unchanged when the run was planned (tenants.compute).
    typed = f"::text[]::{target.tenant_type}[]" if target.tenant_type else "::text[]"
    own = f"(%(oc)s::timestamptz[])[array_position(%(ot)s{typed}, {tenant})]"
    return [
        f"{ts} < {cutoff_value(target, '%(latest_cutoff)s::timestamptz')}",
        f"{ts} < {cutoff_value(target, f'coalesce({own}, %(cutoff)s::timestamptz)')}",
        f"(cardinality(%(xt)s::text[]) = 0 OR {tenant} <> ALL(%(xt)s{typed}))",
    ]


def _key(policy: RetentionPolicy) -> str:
    if policy.key_column is None:
        raise ValueError(f"policy {policy.name!r} has no key_column; key ranges need one")
    return quote_ident(policy.key_column)


def _one_tenant(policy: RetentionPolicy, target: TargetInfo) -> str:
    # One tenant at a time: "= value" lets the (tenant, key) index return keys in order.
    if policy.tenant_column is None or target.tenant_type is None:
        raise ValueError("a tenant filter needs a tenant column")
    return f"{quote_ident(policy.tenant_column)} = %(tenant)s::text::{target.tenant_type}"


def batch_statement_returns_counts(policy: RetentionPolicy) -> bool:
    """Whether :func:`batch_statement` returns its counts as rows; otherwise the driver's rowcount is
    the number of rows deleted."""
    return policy.dry_run or policy.archive_table is not None or batch_counts_tenants(policy)


def batch_counts_tenants(policy: RetentionPolicy) -> bool:
    """Whether :func:`batch_statement` returns one row per tenant (tenant, deleted, archived, matched):
    one-pass tenant policies (block chunks with a tenant column) count every tenant of every batch."""
    return policy.tenant_column is not None and policy.chunk_by == "block"


def batch_walk_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """A batch's extent: the ``%(limit)s``-th key of the range from ``lo`` (of one tenant when filtered),
    eligible or not, found by walking the key index (an index-only scan). No row means fewer keys were
    left: the batch runs to the end of the range."""
    table = target_from(policy)
    key = _key(policy)
    walk = [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"]
    if tenant_filter:
        walk.append(_one_tenant(policy, target))
    where = " AND ".join(walk)
    return f"SELECT {key} FROM {table}\nWHERE {where}\nORDER BY {key}\nOFFSET %(limit)s::integer - 1 LIMIT 1"


def batch_statement(
    policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool, relation: TableName | None = None
) -> str:
    """One batch: a range ``DELETE`` of the eligible rows with keys in ``[lo, upper]`` (the extent found
    by :func:`batch_walk_statement`), re-checking the whole predicate (a row reopened since planning
    survives), optionally moving them to the archive table. A range delete reads each row once, in index
    order, and the bounds travel as values so the server plans it for the range it really is.

    With an archive table or ``dry_run`` it returns one row: rows deleted, rows archived, rows that
    would be deleted (``dry_run``: nothing is deleted, the statement only counts); otherwise it is a
    plain ``DELETE`` whose row count is the count. Block batches run on ``relation`` (a leaf partition)
    when given: a TID range only means something on one physical table.
    """
    table = target_from(policy, relation)
    if policy.chunk_by == "block":
        # A TID range scan: the batch reads its blocks in order, like a slice of a sequential scan.
        in_batch = _in_blocks(eligibility(policy, target, tenant_filter=False, key_range=False))
    else:
        key = _key(policy)
        in_batch = f"{key} <= %(upper)s::bigint\n  AND {eligibility(policy, target, tenant_filter=tenant_filter)}"
    if batch_counts_tenants(policy):
        raise ValueError("a one-pass tenant policy's batches come from tenant_batch()")
    if policy.dry_run:
        return f"SELECT 0::bigint, 0::bigint, (SELECT count(*) FROM {table} WHERE {in_batch})"
    if not batch_statement_returns_counts(policy):
        # A plain DELETE: the driver's rowcount is the count (a RETURNING CTE would materialise every row).
        return f"DELETE FROM {table}\nWHERE {in_batch}"
    cols = ", ".join(quote_ident(c) for c in target.columns)
    return (
        f"WITH deleted AS (\n  DELETE FROM {table}\n  WHERE {in_batch}\n  RETURNING {cols}\n),\n"
        f"archived AS (\n  INSERT INTO {policy.archive_table.sql} ({cols})\n  SELECT {cols} FROM deleted\n"
        "  RETURNING 1\n)\n"
        "SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM archived), 0::bigint"
    )


@dataclass(frozen=True)
class TenantBatch:
    """A one-pass batch: every tenant's eligible rows of the blocks, and how many per tenant.

    ``count`` returns one row per tenant (tenant as text, deleted, archived, matched). When ``delete``
    is set, ``count`` only counts and ``delete`` then deletes the same rows: both must run in one
    ``REPEATABLE READ`` transaction, so that they see one snapshot (a row changed by someone else in
    between fails the ``DELETE`` with a serialization error instead of slipping past the count). That
    costs a second read of blocks already in memory, where ``DELETE … RETURNING <tenant>`` would keep
    every deleted row in a tuplestore before grouping it: measured 1.3x against 1.6x the time of the
    plain ``DELETE`` (docs/performance.md). With an archive table the rows are read once anyway, so
    ``count`` deletes, archives and counts in one statement; a dry run only counts.
    """

    count: str
    delete: str | None = None

    @property
    def needs_snapshot(self) -> bool:
        return self.delete is not None


def tenant_batch(policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None) -> TenantBatch:
    """The one-pass batch over the blocks ``[%(lo_tid)s, %(hi_tid)s)``. ``%(only)s`` (text[], NULL for
    all) restricts it to some tenants: the engine's way round a tenant whose rows fail; ``%(skip)s``
    leaves out the chunk's dead letters."""
    table = target_from(policy, relation)
    tenant = quote_ident(str(policy.tenant_column))
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    in_batch = _in_blocks(pred) + _tenant_choice(tenant)
    # A dry run only counts, archive table or not: it never reaches the DELETE of the archive branch
    # (and runs read-only besides, core/running/engine.py).
    if policy.archive_table is None or policy.dry_run:
        # The alias keeps GROUP BY on the column's own type; the text cast is paid once per tenant.
        counted = "0::bigint, 0::bigint, count(*)" if policy.dry_run else "count(*), 0::bigint, 0::bigint"
        count = f"SELECT {tenant}::text, {counted} FROM {table}\nWHERE {in_batch}\nGROUP BY {tenant} ORDER BY 1"
        return TenantBatch(count, None if policy.dry_run else f"DELETE FROM {table}\nWHERE {in_batch}")
    cols = ", ".join(quote_ident(c) for c in target.columns)
    return TenantBatch(
        f"WITH deleted AS (\n  DELETE FROM {table}\n  WHERE {in_batch}\n  RETURNING {cols}\n),\n"
        f"archived AS (\n  INSERT INTO {policy.archive_table.sql} ({cols})\n  SELECT {cols} FROM deleted\n"
        f"  RETURNING {tenant}\n)\n"
        f"SELECT d.t, d.n, coalesce(a.n, 0), 0::bigint\n"
        f"FROM (SELECT {tenant}::text AS t, count(*) AS n FROM deleted GROUP BY 1) d\n"
        f"LEFT JOIN (SELECT {tenant}::text AS t, count(*) AS n FROM archived GROUP BY 1) a USING (t) ORDER BY 1"
    )


def _in_blocks(pred: str) -> str:
    return "ctid >= %(lo_tid)s::tid AND ctid < %(hi_tid)s::tid\n  AND " + pred


def _tenant_choice(tenant: str) -> str:
    """One-pass statements: only the ``%(only)s`` tenants (NULL: all), never the ``%(skip)s`` ones (the
    chunk's dead letters: their rows failed, and are left)."""
    # Written so that the server folds each test away when its list is NULL or empty (the usual
    # batch): otherwise every row of the batch pays a text cast of its tenant (10 % of the batch).
    return (
        f"\n  AND (%(only)s::text[] IS NULL OR {tenant}::text = ANY(%(only)s::text[]))"
        f"\n  AND (cardinality(%(skip)s::text[]) = 0 OR {tenant}::text <> ALL(%(skip)s::text[]))"
    )


def tenants_in_batch_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None) -> str:
    """The tenants with eligible rows in a one-pass batch's blocks (``%(lo_tid)s``, ``%(hi_tid)s``)."""
    tenant = quote_ident(str(policy.tenant_column))
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    return (
        f"SELECT DISTINCT {tenant}::text FROM {target_from(policy, relation)}\n"
        f"WHERE {_in_blocks(pred)}{_tenant_choice(tenant)}\nORDER BY 1"
    )


def block_sample_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None) -> str:
    """Eligible rows per block in a repeatable sample of ``%(percent)s`` % of the blocks of the table (or
    of ``relation``, a leaf partition): the block planner's estimate of where the eligible rows are,
    without reading the table."""
    return _eligible_per_block(policy, target, relation, "", " TABLESAMPLE SYSTEM (%(percent)s::float8) REPEATABLE (0)")


def eligible_spans_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None) -> str:
    """Eligible rows per span of ``%(span)s`` consecutive blocks, counted exactly: the block planner's map
    of the blocks a run must read, when a selective cutoff lets the server reach the eligible rows
    through an index (the planner asks ``EXPLAIN`` first) instead of reading the table (or ``relation``,
    a leaf partition)."""
    return _eligible_per_block(policy, target, relation, " / %(span)s::bigint", "")


def _eligible_per_block(
    policy: RetentionPolicy, target: TargetInfo, relation: TableName | None, per: str, sample: str
) -> str:
    """Eligible rows grouped by their block number (``per``: divided into spans), in block order."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    return (
        f"SELECT (ctid::text::point)[0]::bigint{per}, count(*) FROM {target_from(policy, relation)}{sample}"
        f"\nWHERE {pred}\nGROUP BY 1 ORDER BY 1"
    )


# The table's size in blocks now, the server's estimate of its rows (reltuples), the server's version.
BLOCK_COUNT = (
    "SELECT pg_relation_size(%(rel)s::regclass) / current_setting('block_size')::bigint,"
    " (SELECT reltuples FROM pg_catalog.pg_class WHERE oid = %(rel)s::regclass)::float8,"
    " current_setting('server_version_num')::integer"
)


def group_statement(policy: RetentionPolicy, target: TargetInfo) -> str:
    """Eligible rows per tenant (one group when the policy has no tenant column): tenant as text,
    count, lowest and highest key. Parameters: ``cutoff``, ``lo``, ``hi`` (pass the bigint range)."""
    table = target_from(policy)
    key = _key(policy)
    pred = eligibility(policy, target, tenant_filter=False, null_tenants=True)
    if policy.tenant_column is None:
        return f"SELECT NULL::text, count(*), min({key}), max({key}) FROM {table}\nWHERE {pred}"
    tenant = quote_ident(policy.tenant_column)
    return (
        # The alias keeps ORDER BY on the column's own type (numeric tenants in numeric order).
        f"SELECT {tenant}::text AS tenant_value, count(*), min({key}), max({key}) FROM {table}\nWHERE {pred}\n"
        f"GROUP BY {tenant}\nORDER BY {tenant}"
    )


def boundary_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """The key of the ``%(offset)s``-th eligible row at or after ``lo`` (0-based), i.e. the first key of
    the next chunk, found by the server walking the index: the client never holds the keys."""
    table = target_from(policy)
    key = _key(policy)
    pred = eligibility(policy, target, tenant_filter=tenant_filter)
    return f"SELECT {key} FROM {table}\nWHERE {pred}\nORDER BY {key}\nOFFSET %(offset)s::bigint LIMIT 1"


def leftover_statement(policy: RetentionPolicy, target: TargetInfo, *, since: bool = False) -> str:
    """What a run left behind: the oldest eligible timestamp (an index walk on the timestamp) and how
    many eligible rows remain, counted up to ``%(cap)s``. Parameters: ``cutoff``, ``lo``, ``hi`` with
    key chunks, and with ``since`` a lower bound ``%(since)s`` on the timestamp (the lag window)."""
    table = target_from(policy)
    ts = quote_ident(policy.timestamp_column)
    pred = eligibility(policy, target, tenant_filter=False, key_range=policy.chunk_by == "key")
    if since:
        pred = f"{ts} >= {cutoff_value(target, '%(since)s::timestamptz')}\n  AND {pred}"
    # One walk of the timestamp index for both: it passes every held-back row in its window and, until
    # VACUUM, every dead entry (0.5 us each on the first walk after a purge), hence the window.
    return (
        f"SELECT min({ts}), count(*) FROM\n"
        f"  (SELECT {ts} FROM {table} WHERE {pred} ORDER BY {ts} LIMIT %(cap)s::bigint) s"
    )


# How the tenant column's values follow the table's physical order (pg_stats, after ANALYZE): near 0
# when every tenant's rows are spread over every block.
TENANT_CORRELATION = (
    "SELECT s.correlation FROM pg_catalog.pg_stats s"
    " JOIN pg_catalog.pg_class c ON c.relname = s.tablename"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace AND n.nspname = s.schemaname"
    " WHERE c.oid = %(rel)s::regclass AND s.attname = %(col)s"
)


def null_timestamps_statement(policy: RetentionPolicy) -> str:
    """Rows whose timestamp is NULL: never eligible (``NULL < cutoff`` is not true), so reported."""
    return f"SELECT count(*) FROM {target_from(policy)} WHERE {quote_ident(policy.timestamp_column)} IS NULL"


def condition_probe(policy: RetentionPolicy) -> str:
    """A statement that makes the server parse and plan the condition without reading a row; it is run
    without parameters, so the condition goes in as written; the target has the alias of every other
    statement (:func:`target_from`)."""
    return f"EXPLAIN SELECT 1 FROM {target_from(policy)} WHERE (\n{policy.condition}\n)"


# -- partitioned tables (planning/partitions.py plans them, running/detach.py runs partition chunks) --

# The relation's kind: 'r' table, 'p' partitioned table, 'v' view, 'f' foreign table, 'm' materialized view.
RELATION_KIND = "SELECT c.relkind::text FROM pg_catalog.pg_class c WHERE c.oid = %(rel)s::regclass"

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


def bound_check_statement(target: TargetInfo) -> str:
    """For RANGE bounds on the timestamp column given as text (``%(lows)s``, ``%(highs)s``, NULL for
    MINVALUE/MAXVALUE): whether the lower bound is at or after ``%(newer_from)s`` (no row can be
    eligible) and whether the upper bound is at or before ``%(expired_by)s`` (every row is expired by
    time); both are the run's cutoff unless tenants have cutoffs of their own. The texts come from
    ``pg_get_expr`` in the same session, so they read back exactly."""
    typ = "timestamptz" if target.timestamp_has_tz else "timestamp"
    newer = cutoff_value(target, "%(newer_from)s::timestamptz")
    expired = cutoff_value(target, "%(expired_by)s::timestamptz")
    return (
        f"SELECT coalesce(b.lo::{typ} >= {newer}, false), coalesce(b.hi::{typ} <= {expired}, false)"
        " FROM unnest(%(lows)s::text[], %(highs)s::text[]) WITH ORDINALITY AS b(lo, hi, ord) ORDER BY b.ord"
    )


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


def detach_statement(parent: TableName, partition: TableName, mode: str) -> str:
    """``ALTER TABLE parent DETACH PARTITION partition`` with ``mode`` ``CONCURRENTLY``, ``FINALIZE`` or
    ``""`` (plain: in a transaction, ACCESS EXCLUSIVE on the parent until commit)."""
    if mode not in ("CONCURRENTLY", "FINALIZE", ""):
        raise ValueError(f"unknown detach mode {mode!r}")
    return f"ALTER TABLE {parent.sql} DETACH PARTITION {partition.sql}" + (f" {mode}" if mode else "")


def lock_statement(relation: TableName, mode: str, *, only: bool = False) -> str:
    """``LOCK TABLE`` in one of the modes the engine takes: ``SHARE`` (writers wait, so a count and a
    check stay true until commit), ``ROW EXCLUSIVE`` (what a DELETE takes anyway: a concurrent detach
    cannot finish while a batch runs) or ``ACCESS EXCLUSIVE`` (a plain detach: taken on the parent
    first, as writers through the parent take theirs), or ``ACCESS SHARE`` (a dry run's leaf: read
    only, and still no DETACH can finish). ``only``: not the relation's partitions."""
    if mode not in ("ACCESS SHARE", "SHARE", "ROW EXCLUSIVE", "ACCESS EXCLUSIVE"):
        raise ValueError(f"unknown lock mode {mode!r}")
    return f"LOCK TABLE {'ONLY ' if only else ''}{relation.sql} IN {mode} MODE"


def count_statement(relation: TableName) -> str:
    return f"SELECT count(*) FROM {relation.sql}"


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


def partition_census_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName) -> str:
    """A partition about to be removed, in one scan: per tenant (one row, tenant NULL, without a tenant
    column; no row for an empty partition with one), the tenant as text, its rows, and how many of them
    the policy keeps (the condition fails or is NULL, no tenant, a tenant's own cutoff not reached).
    The partition is removed only when that last number is 0 everywhere: then every row counted is one
    the policy deletes, and the rows per tenant are the chunk's ``tenant_counts``."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    kept = f"count(*) FILTER (WHERE NOT coalesce((\n  {pred}\n), false))"
    source = target_from(policy, relation)
    if policy.tenant_column is None:
        return f"SELECT NULL::text, count(*), {kept} FROM {source}"
    tenant = quote_ident(policy.tenant_column)
    # Grouped on the column's own type; the text cast is paid once per tenant.
    return f"SELECT {tenant}::text AS tenant_value, count(*), {kept} FROM {source}\nGROUP BY {tenant} ORDER BY 1"


def drop_statement(relation: TableName) -> str:
    return f"DROP TABLE {relation.sql}"


def ineligible_exists_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName) -> str:
    """Whether ``relation`` holds a row the policy keeps (the condition fails, or is NULL): a partition
    with such a row must not be detached or dropped. Stops at the first one."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    return f"SELECT EXISTS (SELECT 1 FROM {target_from(policy, relation)} WHERE NOT coalesce((\n  {pred}\n), false))"


def eligible_exists_statement(
    policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None, *, null_tenants: bool = False
) -> str:
    """Whether ``relation`` (default: the policy's table, every leaf of a partitioned one) holds an
    eligible row now (an index walk where there is an index). ``null_tenants``: a row without a tenant
    counts too (the key planner warns about those, so it must see them)."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False, null_tenants=null_tenants)
    return f"SELECT EXISTS (SELECT 1 FROM {target_from(policy, relation)} WHERE {pred})"


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
