"""Quick reads before and beside a plan: the proof that a run has nothing to delete, the warnings
about rows that never expire (NULL timestamps) and about interleaved tenants, and the check of a lone
chunk's range.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import BLOCK_COUNT, RELATION_KIND, TENANT_CORRELATION, TIMESTAMP_INDEXES
from airflow_retention.core.sql.reads import (
    eligible_exists_statement,
    null_timestamps_statement,
)
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


# A run with nothing eligible (a backfill of a day a later run already purged) is proven empty by one
# EXISTS through an index on the timestamp column, which answers in milliseconds when no row is old
# enough. A probe still walking past this (many old rows the condition keeps, or index entries of rows
# deleted since and not yet vacuumed) gives up, and the run is planned as without the probe.
EMPTY_PROBE_TIMEOUT_MS = 2_000


def nothing_eligible(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, *, null_tenants: bool = False
) -> str | None:
    """Why the run has nothing to delete, proven by one exact probe through an index on the timestamp
    column, or None: some row is eligible, the table (or one of its leaves) has no btree index led by
    the timestamp column, or the probe could not tell within :data:`EMPTY_PROBE_TIMEOUT_MS`.

    The probe is ``EXISTS`` over the predicate of every statement
    (:func:`~airflow_retention.core.sql.predicate.eligibility`): each tenant against its own frozen cutoff,
    bounded by the latest of them (the index range), and the condition. It says "nothing" only when no
    row is eligible as planning sees it.

    :param null_tenants: rows without a tenant count as found (the key planner warns about them).
    """
    leaves = dbapi.fetch_all(
        conn, TIMESTAMP_INDEXES, {"rel": policy.table.regclass_literal, "col": policy.timestamp_column}
    )
    missing = sum(1 for _, index in leaves if index is None)
    if not leaves or missing:
        log.debug(
            "policy %s: %d of %d leaf relation(s) of %s have no btree index led by %s: no probe for an empty run",
            policy.name,
            missing,
            len(leaves),
            policy.table,
            policy.timestamp_column,
        )
        return None
    try:
        with dbapi.transaction(conn, read_only=True) as cur:
            dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, EMPTY_PROBE_TIMEOUT_MS)
            # A sequential scan of a table with nothing eligible reads all of it: what the probe saves.
            cur.execute("SET LOCAL enable_seqscan = off")
            cur.execute(eligible_exists_statement(policy, target, null_tenants=null_tenants), cutoffs.params())
            (found,) = cur.fetchone()
    except RetryableError as exc:
        if exc.sqlstate != "57014":
            raise
        log.info(
            "policy %s: the probe for eligible rows of %s through its index on %s took over %d ms: planned as usual",
            policy.name,
            policy.table,
            policy.timestamp_column,
            EMPTY_PROBE_TIMEOUT_MS,
        )
        return None
    if found:
        return None
    before = "before its tenant's cutoff" if cutoffs.overrides else "before the cutoff"
    if policy.condition:
        before += " that the condition selects"
    if len(leaves) == 1 and not target.partitioned:
        through = f"through index {leaves[0][1]}"
    else:
        through = f"through the index on {policy.timestamp_column} of each of its {len(leaves)} leaf partition(s)"
    reason = f"nothing eligible: no row of {policy.table} {before} {through}"
    log.info("policy %s: %s: 0 chunks", policy.name, reason)
    return reason


def warn_null_timestamps(conn: Any, policy: RetentionPolicy) -> int:
    (count,) = dbapi.fetch_all(conn, null_timestamps_statement(policy), lock_timeout_ms=policy.lock_timeout_ms)[0]
    if count:
        log.warning(
            "policy %s: %d row(s) of %s have a NULL %s: they are never deleted; give them a timestamp or"
            " delete them by hand",
            policy.name,
            count,
            policy.table,
            policy.timestamp_column,
        )
    return int(count)


# Below this |correlation| the tenants' rows share their blocks.
INTERLEAVED_BELOW = 0.5


def warn_interleaved_tenants(conn: Any, policy: RetentionPolicy) -> float | None:
    """Warn when the tenants' rows are spread over the same blocks: per-tenant batches then change every
    block once per tenant (measured at 10M rows with 50 tenants: 0.03x the speed and 22x the WAL of one
    DELETE, since each pass after a checkpoint writes full-page images again)."""
    rows = dbapi.fetch_all(
        conn, TENANT_CORRELATION, {"rel": policy.table.regclass_literal, "col": policy.tenant_column}
    )
    correlation = rows[0][0] if rows else None
    if correlation is not None and abs(correlation) < INTERLEAVED_BELOW:
        log.warning(
            "policy %s: the rows of different %s values are interleaved in %s (correlation %.2f with the"
            " table's physical order): per-tenant chunks rewrite each block once per tenant, with much"
            " more WAL and time than one pass; use chunk_by 'block' (one pass over every tenant, rows still"
            " counted per tenant) unless per-tenant chunks are worth it (docs/performance.md)",
            policy.name,
            policy.tenant_column,
            policy.table,
            correlation,
        )
    return correlation


def check_lone_range(conn: Any, policy: RetentionPolicy, chunk: ChunkSpec) -> None:
    """Refuse a lone chunk whose range starts past the table's end, where it could only succeed with 0
    rows: mistyped numbers, or keys given as block numbers. Block ranges (``policy.chunk_by`` block, or a
    partition's leaf): its first block at or past the relation's size in blocks. Key ranges: its first
    key above the table's largest key. A range that starts inside and runs past the end stops there
    (``blocks=(0, 2**62)`` is the whole table); an empty table has no end to start past.

    :raises PermanentError: naming the range, the table's end and the fix; nothing was written.
    """
    if chunk.action is not None:
        return  # a whole partition: no range
    if policy.chunk_by == "block" or chunk.partition is not None:
        relation = TableName.parse(chunk.partition) if chunk.partition is not None else policy.table
        if chunk.partition is None:
            (kind,) = dbapi.fetch_all(conn, RELATION_KIND, {"rel": relation.regclass_literal})[0]
            if kind == "p":
                # A partitioned table has no blocks of its own: the range would succeed with 0 rows.
                raise PermanentError(
                    f"policy {policy.name!r}: chunk {chunk.key}: blocks=({chunk.lo}, {chunk.hi}) on {relation},"
                    " a partitioned table, which has no blocks of its own: block numbers belong to one leaf"
                    " partition (give partition='schema.leaf' with the range), or give keys=(lo, hi) for a"
                    " key range; nothing was deleted"
                )
        try:
            (blocks, _, _) = dbapi.fetch_all(conn, BLOCK_COUNT, {"rel": relation.regclass_literal})[0]
        except PermanentError:
            if chunk.partition is None:
                raise
            return  # a leaf gone since: the chunk completes as partition_gone
        if blocks and chunk.lo >= int(blocks):
            raise PermanentError(
                f"policy {policy.name!r}: chunk {chunk.key}: blocks=({chunk.lo}, {chunk.hi}) starts past the end of"
                f" {relation}, which has {int(blocks):,} block(s) (0 to {int(blocks) - 1}): there is nothing to purge"
                " there. Block numbers are the table's physical pages, not keys: give keys=(lo, hi) for a key"
                " range; nothing was deleted"
            )
        return
    key = quote_ident(str(policy.key_column))
    (top,) = dbapi.fetch_all(
        conn, f"SELECT max({key})::bigint FROM {policy.table.sql}", lock_timeout_ms=policy.lock_timeout_ms
    )[0]
    if top is not None and chunk.lo > int(top):
        raise PermanentError(
            f"policy {policy.name!r}: chunk {chunk.key}: keys=({chunk.lo}, {chunk.hi}) starts past the largest"
            f" {policy.key_column} of {policy.table}, {int(top):,}: no row is in that range; nothing was deleted"
        )
