"""Every statement that reads or deletes rows of a policy's target table, built in one place.

Identifiers are quoted by :mod:`identifiers`; values travel as parameters with explicit casts; the
policy's ``condition`` (trusted SQL) is wrapped in parentheses on lines of its own.
"""

from __future__ import annotations

from airflow_retention.core.catalog import TargetInfo
from airflow_retention.core.identifiers import quote_ident
from airflow_retention.core.policy import RetentionPolicy

_KEY_ALIAS = "retention_key__"


def eligibility(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool, null_tenants: bool = False) -> str:
    """The predicate of an eligible row in the range ``[%(lo)s, %(hi)s)``, optionally of given tenants.

    Parameters: ``lo``, ``hi`` (bigint), ``cutoff`` (timestamptz), ``tenants`` (text[]) when filtered.
    A ``timestamp without time zone`` column is read as UTC. In a policy with a tenant column, a row
    whose tenant is NULL belongs to no tenant and is never eligible (``null_tenants`` lets the planner
    count them, to warn).
    """
    key = quote_ident(policy.key_column)
    ts = quote_ident(policy.timestamp_column)
    cutoff = "%(cutoff)s::timestamptz" if target.timestamp_has_tz else "(%(cutoff)s::timestamptz AT TIME ZONE 'UTC')"
    parts = [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint", f"{ts} < {cutoff}"]
    if tenant_filter:
        if policy.tenant_column is None or target.tenant_type is None:
            raise ValueError("a tenant filter needs a tenant column")
        parts.append(f"{quote_ident(policy.tenant_column)} = ANY(%(tenants)s::text[]::{target.tenant_type}[])")
    elif policy.tenant_column is not None and not null_tenants:
        parts.append(f"{quote_ident(policy.tenant_column)} IS NOT NULL")
    if policy.condition:
        # Statements built here always travel with parameters: a literal % (LIKE 'a%') must be doubled.
        parts.append(f"(\n{policy.condition.replace('%', '%%')}\n)")
    return "\n  AND ".join(parts)


def batch_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """One batch: pick at most ``%(limit)s`` eligible keys from ``lo`` in key order, delete them while
    re-checking the whole predicate (a row reopened since it was picked survives), optionally move them
    to the archive table. Returns one row: keys picked, last key picked, rows deleted, rows archived.

    With ``dry_run`` nothing is deleted: the statement only picks and counts.
    """
    table = policy.table.sql
    key = quote_ident(policy.key_column)
    pred = eligibility(policy, target, tenant_filter=tenant_filter)
    pick = (
        f"WITH batch AS MATERIALIZED (\n"
        f"  SELECT {key} AS {_KEY_ALIAS} FROM {table}\n  WHERE {pred}\n"
        f"  ORDER BY {key}\n  LIMIT %(limit)s::integer\n)"
    )
    if policy.dry_run:
        return (
            f"{pick}\nSELECT (SELECT count(*) FROM batch), (SELECT max({_KEY_ALIAS}) FROM batch), 0::bigint, 0::bigint"
        )
    delete = (
        f",\ndeleted AS (\n  DELETE FROM {table}\n  WHERE {key} IN (SELECT {_KEY_ALIAS} FROM batch)\n  AND {pred}\n"
    )
    if policy.archive_table is None:
        return (
            f"{pick}{delete}  RETURNING 1\n)\n"
            f"SELECT (SELECT count(*) FROM batch), (SELECT max({_KEY_ALIAS}) FROM batch),"
            " (SELECT count(*) FROM deleted), 0::bigint"
        )
    cols = ", ".join(quote_ident(c) for c in target.columns)
    return (
        f"{pick}{delete}  RETURNING {cols}\n),\n"
        f"archived AS (\n  INSERT INTO {policy.archive_table.sql} ({cols})\n  SELECT {cols} FROM deleted\n"
        "  RETURNING 1\n)\n"
        f"SELECT (SELECT count(*) FROM batch), (SELECT max({_KEY_ALIAS}) FROM batch),"
        " (SELECT count(*) FROM deleted), (SELECT count(*) FROM archived)"
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


def null_timestamps_statement(policy: RetentionPolicy) -> str:
    """Rows whose timestamp is NULL: never eligible (``NULL < cutoff`` is not true), so reported."""
    return f"SELECT count(*) FROM {policy.table.sql} WHERE {quote_ident(policy.timestamp_column)} IS NULL"


def condition_probe(policy: RetentionPolicy) -> str:
    """A statement that makes the server parse and plan the condition without reading a row; it is run
    without parameters, so the condition goes in as written."""
    return f"EXPLAIN SELECT 1 FROM {policy.table.sql} WHERE (\n{policy.condition}\n)"
