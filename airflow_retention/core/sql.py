"""Every statement that reads or deletes rows of a policy's target table, built in one place.

Identifiers are quoted by :mod:`identifiers`; values travel as parameters with explicit casts; the
policy's ``condition`` (trusted SQL) is wrapped in parentheses on lines of its own.
"""

from __future__ import annotations

from airflow_retention.core.catalog import TargetInfo
from airflow_retention.core.identifiers import quote_ident
from airflow_retention.core.policy import RetentionPolicy

# The whole key space, for statements that are not limited to a chunk. Not -2**63: psycopg2 sends
# -9223372036854775808::bigint, which overflows before the negation.
MIN_KEY = -(2**63) + 1
MAX_KEY = 2**63 - 1


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
    key = quote_ident(policy.key_column)
    ts = quote_ident(policy.timestamp_column)
    cutoff = "%(cutoff)s::timestamptz" if target.timestamp_has_tz else "(%(cutoff)s::timestamptz AT TIME ZONE 'UTC')"
    parts = [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"] if key_range else []
    parts.append(f"{ts} < {cutoff}")
    if tenant_filter:
        parts.append(_one_tenant(policy, target))
    elif policy.tenant_column is not None and not null_tenants:
        parts.append(f"{quote_ident(policy.tenant_column)} IS NOT NULL")
    if policy.condition:
        # Statements built here always travel with parameters: a literal % (LIKE 'a%') must be doubled.
        parts.append(f"(\n{policy.condition.replace('%', '%%')}\n)")
    return "\n  AND ".join(parts)


def _one_tenant(policy: RetentionPolicy, target: TargetInfo) -> str:
    # One tenant at a time: "= value" lets the (tenant, key) index return keys in order.
    if policy.tenant_column is None or target.tenant_type is None:
        raise ValueError("a tenant filter needs a tenant column")
    return f"{quote_ident(policy.tenant_column)} = %(tenant)s::text::{target.tenant_type}"


def batch_statement_returns_counts(policy: RetentionPolicy) -> bool:
    """Whether :func:`batch_statement` returns its counts as a row; otherwise the driver's rowcount is
    the number of rows deleted."""
    return policy.dry_run or policy.archive_table is not None


def batch_walk_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """A batch's extent: the ``%(limit)s``-th key of the range from ``lo`` (of one tenant when filtered),
    eligible or not, found by walking the key index (an index-only scan). No row means fewer keys were
    left: the batch runs to the end of the range."""
    table = policy.table.sql
    key = quote_ident(policy.key_column)
    walk = [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"]
    if tenant_filter:
        walk.append(_one_tenant(policy, target))
    where = " AND ".join(walk)
    return f"SELECT {key} FROM {table}\nWHERE {where}\nORDER BY {key}\nOFFSET %(limit)s::integer - 1 LIMIT 1"


def batch_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """One batch: a range ``DELETE`` of the eligible rows with keys in ``[lo, upper]`` (the extent found
    by :func:`batch_walk_statement`), re-checking the whole predicate (a row reopened since planning
    survives), optionally moving them to the archive table. A range delete reads each row once, in index
    order, and the bounds travel as values so the server plans it for the range it really is.

    With an archive table or ``dry_run`` it returns one row: rows deleted, rows archived, rows that
    would be deleted (``dry_run``: nothing is deleted, the statement only counts); otherwise it is a
    plain ``DELETE`` whose row count is the count.
    """
    table = policy.table.sql
    key = quote_ident(policy.key_column)
    if policy.chunk_by == "block":
        # A TID range scan: the batch reads its blocks in order, like a slice of a sequential scan.
        pred = eligibility(policy, target, tenant_filter=False, key_range=False)
        in_batch = "ctid >= %(lo_tid)s::tid AND ctid < %(hi_tid)s::tid\n  AND " + pred
    else:
        in_batch = f"{key} <= %(upper)s::bigint\n  AND {eligibility(policy, target, tenant_filter=tenant_filter)}"
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


def block_sample_statement(policy: RetentionPolicy, target: TargetInfo) -> str:
    """Eligible rows per block in a repeatable sample of ``%(percent)s`` % of the table's blocks: the block
    planner's estimate of where the eligible rows are, without reading the table."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    return (
        f"SELECT (ctid::text::point)[0]::bigint AS block, count(*) FROM {policy.table.sql}"
        f" TABLESAMPLE SYSTEM (%(percent)s::float8) REPEATABLE (0)\nWHERE {pred}\nGROUP BY 1 ORDER BY 1"
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
    table = policy.table.sql
    key = quote_ident(policy.key_column)
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
    table = policy.table.sql
    key = quote_ident(policy.key_column)
    pred = eligibility(policy, target, tenant_filter=tenant_filter)
    return f"SELECT {key} FROM {table}\nWHERE {pred}\nORDER BY {key}\nOFFSET %(offset)s::bigint LIMIT 1"


def leftover_statement(policy: RetentionPolicy, target: TargetInfo) -> str:
    """What a run left behind: the oldest eligible timestamp (an index walk on the timestamp) and how
    many eligible rows remain, counted up to ``%(cap)s``. Parameters: ``cutoff``, ``lo``, ``hi``."""
    table = policy.table.sql
    ts = quote_ident(policy.timestamp_column)
    pred = eligibility(policy, target, tenant_filter=False)
    return (
        f"SELECT (SELECT {ts} FROM {table} WHERE {pred} ORDER BY {ts} LIMIT 1),\n"
        f"       (SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {pred} LIMIT %(cap)s::bigint) s)"
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
    return f"SELECT count(*) FROM {policy.table.sql} WHERE {quote_ident(policy.timestamp_column)} IS NULL"


def condition_probe(policy: RetentionPolicy) -> str:
    """A statement that makes the server parse and plan the condition without reading a row; it is run
    without parameters, so the condition goes in as written."""
    return f"EXPLAIN SELECT 1 FROM {policy.table.sql} WHERE (\n{policy.condition}\n)"
