"""Statements that only read the target table: the planner's samples, spans, groups and chunk
boundaries, the probes of an empty run and of NULL timestamps, and the verification's leftovers.
"""

from __future__ import annotations

from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import cutoff_value, eligibility, key_column, target_from
from airflow_retention.core.sql.target import TargetInfo


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


def group_statement(policy: RetentionPolicy, target: TargetInfo) -> str:
    """Eligible rows per tenant (one group when the policy has no tenant column): tenant as text,
    count, lowest and highest key. Parameters: ``cutoff``, ``lo``, ``hi`` (pass the bigint range)."""
    table = target_from(policy)
    key = key_column(policy)
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
    key = key_column(policy)
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


def null_timestamps_statement(policy: RetentionPolicy) -> str:
    """Rows whose timestamp is NULL: never eligible (``NULL < cutoff`` is not true), so reported."""
    return f"SELECT count(*) FROM {target_from(policy)} WHERE {quote_ident(policy.timestamp_column)} IS NULL"


def eligible_exists_statement(
    policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None, *, null_tenants: bool = False
) -> str:
    """Whether ``relation`` (default: the policy's table, every leaf of a partitioned one) holds an
    eligible row now (an index walk where there is an index). ``null_tenants``: a row without a tenant
    counts too (the key planner warns about those, so it must see them)."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False, null_tenants=null_tenants)
    return f"SELECT EXISTS (SELECT 1 FROM {target_from(policy, relation)} WHERE {pred})"
