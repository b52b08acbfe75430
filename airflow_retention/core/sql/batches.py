"""The batch statements, one per kind of batch, each built from the walker's bounds and the one
eligibility predicate (:mod:`.predicate`): a plain ``DELETE`` (the driver's row count is the count), a
``DELETE`` moving the rows to the archive table, a dry run's count, and the one-pass batch that deletes
every tenant's rows of some blocks and counts them per tenant (:class:`TenantBatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import (
    eligibility,
    in_blocks,
    key_column,
    one_tenant,
    target_from,
    tenant_choice,
    tenant_value,
)
from airflow_retention.core.sql.target import TargetInfo


def batch_statement_returns_counts(policy: RetentionPolicy) -> bool:
    """Whether :func:`batch_statement` returns its counts as rows; otherwise the driver's rowcount is
    the number of rows deleted."""
    return policy.dry_run or policy.archive_table is not None


def batch_counts_tenants(policy: RetentionPolicy, *, listed_tenants: bool = False) -> bool:
    """Whether a chunk's batches are one-pass batches (:func:`tenant_batch`: one row per tenant, tenant,
    deleted, archived, matched): every batch of a policy with a tenant column counts its tenants, so
    that ``tenant_counts`` and ``max_rows_per_tenant`` hold on every path. Block chunks always; key
    chunks that list no tenants (the planner's fallback past too many tenants, a lone key chunk) too;
    key chunks that list their tenants walk them one at a time and count each
    (``listed_tenants``)."""
    return policy.tenant_column is not None and (policy.chunk_by == "block" or not listed_tenants)


def batch_walk_statement(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """A batch's extent: the ``%(limit)s``-th key of the range from ``lo`` (of one tenant when filtered),
    eligible or not, found by walking the key index (an index-only scan). No row means fewer keys were
    left: the batch runs to the end of the range."""
    table = target_from(policy)
    key = key_column(policy)
    walk = [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"]
    if tenant_filter:
        walk.append(one_tenant(policy, target))
    where = " AND ".join(walk)
    return f"SELECT {key} FROM {table}\nWHERE {where}\nORDER BY {key}\nOFFSET %(limit)s::integer - 1 LIMIT 1"


def batch_rows(policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool) -> str:
    """The rows of one batch: the walker's bounds and the eligibility predicate, re-checked in the
    statement itself (a row reopened since planning survives). Block batches: a TID range
    ``[%(lo_tid)s, %(hi_tid)s)``, read in order like a slice of a sequential scan. Key batches: keys in
    ``[lo, upper]`` (the extent found by :func:`batch_walk_statement`) of the range ``[lo, hi)``, read once
    in index order, the bounds travelling as values so the server plans for the range it really is; of
    one tenant when filtered."""
    if policy.chunk_by == "block":
        return in_blocks(eligibility(policy, target, tenant_filter=False, key_range=False))
    key = key_column(policy)
    return f"{key} <= %(upper)s::bigint\n  AND {eligibility(policy, target, tenant_filter=tenant_filter)}"


def plain_delete(table: str, rows: str) -> str:
    """A plain ``DELETE``: the driver's rowcount is the count (a RETURNING CTE would materialise every row)."""
    return f"DELETE FROM {table}\nWHERE {rows}"


def dry_run_count(table: str, rows: str) -> str:
    """A dry run's batch: nothing deleted, one row (0, 0, rows that would be deleted)."""
    return f"SELECT 0::bigint, 0::bigint, (SELECT count(*) FROM {table} WHERE {rows})"


def archive_delete(policy: RetentionPolicy, target: TargetInfo, table: str, rows: str, *, returning: str = "1") -> str:
    """The ``deleted`` and ``archived`` CTEs of a batch that moves its rows to the archive table, every
    column by name; a statement selects its counts from them."""
    assert policy.archive_table is not None
    cols = ", ".join(quote_ident(c) for c in target.columns)
    return (
        f"WITH deleted AS (\n  DELETE FROM {table}\n  WHERE {rows}\n  RETURNING {cols}\n),\n"
        f"archived AS (\n  INSERT INTO {policy.archive_table.sql} ({cols})\n  SELECT {cols} FROM deleted\n"
        f"  RETURNING {returning}\n)\n"
    )


def batch_statement(
    policy: RetentionPolicy, target: TargetInfo, *, tenant_filter: bool, relation: TableName | None = None
) -> str:
    """One batch of a policy without per-tenant counting, by kind: a dry run's count, a ``DELETE`` that
    archives (one row: deleted, archived, matched), or a plain ``DELETE``. Block batches run on
    ``relation`` (a leaf partition) when given: a TID range only means something on one physical table."""
    if batch_counts_tenants(policy, listed_tenants=tenant_filter):
        raise ValueError("a one-pass tenant policy's batches come from tenant_batch()")
    table = target_from(policy, relation)
    rows = batch_rows(policy, target, tenant_filter=tenant_filter)
    if policy.dry_run:
        return dry_run_count(table, rows)
    if policy.archive_table is None:
        return plain_delete(table, rows)
    return (
        archive_delete(policy, target, table, rows)
        + "SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM archived), 0::bigint"
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
    rows = batch_rows(policy, target, tenant_filter=False) + tenant_choice(tenant, target)
    # A dry run only counts, archive table or not: it never reaches the DELETE of the archive branch
    # (and runs read-only besides, core/running/engine.py).
    if policy.archive_table is None or policy.dry_run:
        # The alias keeps GROUP BY on the column's own type; the text cast is paid once per tenant.
        counted = "0::bigint, 0::bigint, count(*)" if policy.dry_run else "count(*), 0::bigint, 0::bigint"
        count = f"SELECT {tenant}::text, {counted} FROM {table}\nWHERE {rows}\nGROUP BY {tenant} ORDER BY 1"
        return TenantBatch(count, None if policy.dry_run else plain_delete(table, rows))
    # Grouped as the column compares tenants, one row (one spelling) per tenant, as the plain DELETE's
    # count is; the archive's column may have another type or collation, so both sides are read as the
    # target's.
    same = tenant_value(target, tenant)
    return TenantBatch(
        archive_delete(policy, target, table, rows, returning=tenant) + "SELECT d.t, d.n, coalesce(a.n, 0), 0::bigint\n"
        f"FROM (SELECT min({tenant}::text) AS t, {same} AS k, count(*) AS n FROM deleted GROUP BY {same}) d\n"
        f"LEFT JOIN (SELECT {same} AS k, count(*) AS n FROM archived GROUP BY {same}) a ON a.k = d.k ORDER BY 1"
    )


def tenants_in_batch_statement(policy: RetentionPolicy, target: TargetInfo, relation: TableName | None = None) -> str:
    """The tenants with eligible rows in a one-pass batch's blocks (``%(lo_tid)s``, ``%(hi_tid)s``) or
    keys (``%(lo)s`` to ``%(upper)s`` of ``[%(lo)s, %(hi)s)``), one per tenant as the column compares them."""
    tenant = quote_ident(str(policy.tenant_column))
    rows = batch_rows(policy, target, tenant_filter=False)
    return (
        f"SELECT {tenant}::text FROM {target_from(policy, relation)}\n"
        f"WHERE {rows}{tenant_choice(tenant, target)}\nGROUP BY {tenant} ORDER BY 1"
    )
