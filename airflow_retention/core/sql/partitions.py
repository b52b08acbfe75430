"""Statements on one partition: the checks before removing it (bounds, census, a kept row), and the
lock, detach, count and drop that remove it.
"""

from __future__ import annotations

from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import cutoff_value, eligibility, target_from
from airflow_retention.core.sql.target import TargetInfo


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


def ineligible_exists_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName) -> str:
    """Whether ``relation`` holds a row the policy keeps (the condition fails, or is NULL): a partition
    with such a row must not be detached or dropped. Stops at the first one."""
    pred = eligibility(policy, target, tenant_filter=False, key_range=False)
    return f"SELECT EXISTS (SELECT 1 FROM {target_from(policy, relation)} WHERE NOT coalesce((\n  {pred}\n), false))"


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


def drop_statement(relation: TableName) -> str:
    return f"DROP TABLE {relation.sql}"
