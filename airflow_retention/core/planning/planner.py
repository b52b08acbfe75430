"""The planner: turn a policy and a frozen cutoff into a deterministic set of chunks, once per run.

Chunks are key ranges [lo, hi) per tenant, each holding at most ``chunk_rows`` rows eligible at
planning time, so that a tenant with 50 times the rows gets 50 times the chunks while small tenants
share a chunk. Boundaries are found by the server walking the index (``OFFSET n LIMIT 1``): the planner
holds one row per tenant, never the eligible keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.ledger.ledger import BLOCK_CHUNK_PREFIX, ChunkSpec, Ledger, MeasuredRate, RunRecord
from airflow_retention.core.planning import tenants
from airflow_retention.core.planning.cutoff import (
    as_utc,
    format_cutoff,
    refuse_future_cutoff,
    require_run_date,
    resolve_run_date,
    run_key,
)
from airflow_retention.core.planning.partitions import PartitionDecision
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.statements import (
    BLOCK_COUNT,
    MAX_KEY,
    MIN_KEY,
    RELATION_KIND,
    TENANT_CORRELATION,
    block_sample_statement,
    boundary_statement,
    eligible_exists_statement,
    eligible_spans_statement,
    group_statement,
    null_timestamps_statement,
)
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)

# A shared chunk lists its tenants in XCom and in the ledger: keep that list bounded.
MAX_TENANTS_PER_CHUNK = 500
_GROWTH = 1.25
# The block planner samples about this many rows (all of a smaller table) to find the eligible ones.
BLOCK_SAMPLE_ROWS = 30_000
MIN_TID_RANGE_SERVER = 140000


# Block chunks bounded by an index, for the nightly purge of a large table: where the sample finds
# eligible rows in at most BOUNDED_MAX_SHARE of its blocks and the server would reach them through an
# index, the planner counts them exactly per span of blocks and plans chunks over the spans that hold
# them, so that one day's rows do not cost a read of the whole table. Below BOUNDED_MIN_BLOCKS (32 MB)
# reading the whole table costs less than counting.
BOUNDED_MIN_BLOCKS = 4096
BOUNDED_MAX_SHARE = 0.5
# Blocks without an eligible row between two spans that hold some: a chunk reads a gap this short
# rather than split there, since reading it (about 0.5 s at the ~65,000 blocks/s measured) costs what
# one more chunk task costs.
BOUNDED_GAP_BLOCKS = 32_768
# At most this many spans come back to the planner, whatever the size of the table.
BOUNDED_MAX_SPANS = 65_536
# The exact count gets half the time a read of every block would take (at the policy's measured rate,
# else the assumed one), and at least this long; past it the plan covers every block, as without an
# index, having lost at most half of what the count was to save.
BOUNDED_TIMEOUT_MS = 10_000
BOUNDED_READ_SHARE = 0.5

# A run with nothing eligible (a backfill of a day a later run already purged) is proven empty by one
# EXISTS through an index on the timestamp column, which answers in milliseconds when no row is old
# enough. A probe still walking past this (many old rows the condition keeps, or index entries of rows
# deleted since and not yet vacuumed) gives up, and the run is planned as without the probe.
EMPTY_PROBE_TIMEOUT_MS = 2_000

# Chunks sized by time: without a measured rate of the policy, rates well below the 0.7-1.1 M rows/s
# and ~65,000 blocks/s one worker reached on a 2-core test machine (docs/performance.md), for slower
# servers and chunks running side by side. Too low a rate only makes chunks shorter than aimed at.
ASSUMED_ROWS_PER_S = {"block": 200_000, "key": 50_000}
ASSUMED_BLOCKS_PER_S = 20_000
# Work is shared among max_active_chunks only in chunks of at least this long: a chunk task costs
# about 0.6 s of scheduling and process start.
MIN_SHARED_CHUNK_S = 10.0


@dataclass(frozen=True)
class ChunkSizing:
    """How many chunks the planner aimed at, from what estimate, and why (the plan's XCom and
    ``airflow-retention plan`` show it).

    :param chunks: the chunk count aimed at (the plan may differ a little: tenants packed, block
        ranges cut by a sample).
    :param chunk_rows: eligible rows per chunk that gives that count.
    :param seconds: the estimated time of the whole run's chunks, one after the other.
    :param measured_chunks: how many chunks of earlier runs the rates come from; 0: assumed rates.
    :param reason: the estimate and the choice, in words.
    """

    chunks: int
    chunk_rows: int
    rows: int
    blocks: int | None
    seconds: float
    rows_per_s: float
    blocks_per_s: float | None
    measured_chunks: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["seconds"] = round(self.seconds, 1)
        data["rows_per_s"] = round(self.rows_per_s)
        data["blocks_per_s"] = round(self.blocks_per_s) if self.blocks_per_s is not None else None
        return data


def size_chunks(
    policy: RetentionPolicy, rows: int, blocks: int | None, rate: MeasuredRate | None, max_chunks: int
) -> ChunkSizing:
    """Pick the chunk count: about ``target_chunk_time`` per chunk at the measured rate (else an assumed
    one), at least ``max_active_chunks`` when each would still take :data:`MIN_SHARED_CHUNK_S`, at
    most ``max_chunks``; ``chunk_rows`` in the policy overrides it.

    :param blocks: the blocks the chunks go through (block chunks), None for key chunks. The estimate
        is the larger of rows over rows/s and blocks over blocks/s, both measured on the same chunks:
        under a time linear in rows and blocks that bounds the time from above, however the share of
        eligible rows per block changed since.
    """
    rps = (rate.rows_per_s if rate else None) or float(ASSUMED_ROWS_PER_S[policy.chunk_by or "block"])
    bps = ((rate.blocks_per_s if rate else None) or float(ASSUMED_BLOCKS_PER_S)) if blocks is not None else None
    seconds = max(rows / rps, blocks / bps if blocks and bps else 0.0)
    basis = f"{rows:,} rows at {rps:,.0f} rows/s" + (f" and {blocks:,} blocks at {bps:,.0f} blocks/s" if bps else "")
    source = f"measured over {rate.chunks} chunk(s) of earlier runs" if rate else "assumed: no earlier run to measure"
    estimate = f"about {seconds:,.0f} s of work ({basis}; rates {source})"
    measured = rate.chunks if rate else 0
    if policy.chunk_rows is not None:
        n = max(1, math.ceil(rows / policy.chunk_rows))
        why = f"chunk_rows {policy.chunk_rows:,} set in the policy: {n} chunk(s) (target_chunk_time not used)"
        return ChunkSizing(n, policy.chunk_rows, rows, blocks, seconds, rps, bps, measured, f"{estimate}; {why}")
    target = policy.target_chunk_ms / 1000
    by_time = math.ceil(seconds / target)
    shared = min(policy.max_active_chunks, int(seconds // MIN_SHARED_CHUNK_S))
    n = max(1, by_time, shared)
    if n > max_chunks:
        n = max_chunks
        why = f"{n} chunks: the {by_time} of target_chunk_time {target:g} s exceed max_map_length {max_chunks}"
    elif n == 1:
        why = f"one chunk: the work fits in target_chunk_time {target:g} s"
    elif shared > by_time:
        why = (
            f"{n} chunks of about {seconds / n:,.0f} s: enough work for max_active_chunks"
            f" {policy.max_active_chunks} to share (at least {MIN_SHARED_CHUNK_S:g} s each)"
        )
    else:
        why = f"{n} chunks of about {seconds / n:,.0f} s (target_chunk_time {target:g} s)"
    # A chunk smaller than a batch would only add tasks.
    chunk_rows = max(policy.batch_size, math.ceil(rows / n))
    return ChunkSizing(n, chunk_rows, rows, blocks, seconds, rps, bps, measured, f"{estimate}; {why}")


def measured_rate(conn: Any, policy: RetentionPolicy, *, blocks: bool) -> MeasuredRate | None:
    """The policy's rate in its earlier runs, when its ledger is there and current."""
    ledger = Ledger(policy.ledger_schema)
    version = ledger.version(conn)
    if version is None or version < 3:  # the columns read came with version 3
        return None
    return ledger.measured_rate(conn, policy.name, dry_run=policy.dry_run, blocks=blocks)


@dataclass(frozen=True)
class Group:
    """Eligible rows of one tenant (or of the whole table): count and key bounds."""

    tenant: str | None
    rows: int
    lo: int
    hi: int  # exclusive


@dataclass(frozen=True)
class Plan:
    run_key: str
    cutoff: datetime
    chunks: list[ChunkSpec]
    rows_planned: int
    chunk_rows: int
    reused: bool
    sizing: ChunkSizing | None = None  # None for a stored plan: the estimate was the first planner's
    # Whether rows_planned comes from a sample or the statistics rather than a count (Preview.rows_estimated);
    # not known to be a count unless said.
    rows_estimated: bool = True

    def expand_kwargs(self) -> list[dict[str, Any]]:
        """One small dict per chunk, the keyword arguments of a mapped ``RetentionChunkOperator``."""
        cutoff = format_cutoff(self.cutoff)
        return [
            {
                "cutoff": cutoff,
                "chunk_key": c.key,
                "lo": c.lo,
                "hi": c.hi,
                "tenants": list(c.tenants) if c.tenants is not None else None,
                "rows_planned": c.rows_planned,
                # Only partitioned tables' chunks carry these: the plan of a plain table stays as it was.
                **(
                    {"partition": c.partition, "partition_oid": c.partition_oid, "action": c.action}
                    if c.partition is not None
                    else {}
                ),
            }
            for c in self.chunks
        ]


def chunk_key(tenants: tuple[str, ...] | None, lo: int, hi: int) -> str:
    """Deterministic, readable chunk identity within a run."""
    if tenants is None:
        part = "all"
    elif len(tenants) == 1:
        part = f"t={tenants[0]}"
    else:
        part = f"t={tenants[0]}..{tenants[-1]}({len(tenants)})"
    return f"{part}:{lo}-{hi}"


def chunk_count(groups: Iterable[Group], chunk_rows: int) -> int:
    """How many chunks :func:`split` makes of these groups, without touching the database."""
    count = 0
    pack_rows = pack_size = 0
    for g in groups:
        if g.rows > chunk_rows:
            count += math.ceil(g.rows / chunk_rows)
            continue
        if pack_size and (pack_rows + g.rows > chunk_rows or pack_size >= MAX_TENANTS_PER_CHUNK):
            count += 1
            pack_rows = pack_size = 0
        pack_rows += g.rows
        pack_size += 1
    return count + (1 if pack_size else 0)


def choose_chunk_rows(groups: list[Group], chunk_rows: int, max_chunks: int) -> int:
    """The smallest chunk size from ``chunk_rows`` up whose plan fits in ``max_chunks`` mapped tasks."""
    total = sum(g.rows for g in groups)
    size = max(chunk_rows, math.ceil(total / max_chunks) if total else chunk_rows)
    while chunk_count(groups, size) > max_chunks:
        size = math.ceil(size * _GROWTH)
    return size


def read_groups(conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs) -> list[Group]:
    rows = dbapi.fetch_all(
        conn,
        group_statement(policy, target),
        {**cutoffs.params(), "lo": MIN_KEY, "hi": MAX_KEY},
        lock_timeout_ms=policy.lock_timeout_ms,
    )
    groups = []
    for tenant, count, lo, hi in rows:
        if not count:
            continue
        if policy.tenant_column is not None and tenant is None:
            log.warning(
                "policy %s: %d eligible row(s) have a NULL %s and are not planned: a NULL tenant belongs to no"
                " chunk; give those rows a tenant or use a policy without tenant_column",
                policy.name,
                count,
                policy.tenant_column,
            )
            continue
        groups.append(Group(tenant=tenant, rows=int(count), lo=int(lo), hi=int(hi) + 1))
    return groups


def _merge(groups: list[Group]) -> Group:
    """All tenants as one group: chunks then cover key ranges of every tenant (``tenants`` None)."""
    return Group(
        tenant=None,
        rows=sum(g.rows for g in groups),
        lo=min(g.lo for g in groups),
        hi=max(g.hi for g in groups),
    )


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


def split(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, groups: list[Group], chunk_rows: int
) -> list[ChunkSpec]:
    """Cut the groups into chunks of at most ``chunk_rows`` eligible rows, in a deterministic order."""
    chunks: list[ChunkSpec] = []
    pack: list[Group] = []

    def flush() -> None:
        if pack:
            tenants = tuple(g.tenant for g in pack if g.tenant is not None) or None
            lo, hi = min(g.lo for g in pack), max(g.hi for g in pack)
            chunks.append(_spec(tenants, lo, hi, sum(g.rows for g in pack), len(chunks)))
            pack.clear()

    for group in groups:
        if group.rows > chunk_rows:
            flush()
            chunks.extend(_walk(conn, policy, target, cutoffs, group, chunk_rows, first_seq=len(chunks)))
            continue
        if pack and (sum(g.rows for g in pack) + group.rows > chunk_rows or len(pack) >= MAX_TENANTS_PER_CHUNK):
            flush()
        pack.append(group)
    flush()
    return chunks


def _walk(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    group: Group,
    chunk_rows: int,
    first_seq: int,
) -> list[ChunkSpec]:
    tenants = (group.tenant,) if group.tenant is not None else None
    statement = boundary_statement(policy, target, tenant_filter=tenants is not None)
    params = {**cutoffs.params(), "hi": group.hi, "offset": chunk_rows, "tenant": group.tenant}
    chunks: list[ChunkSpec] = []
    lo = group.lo
    remaining = group.rows
    while True:
        rows = dbapi.fetch_all(conn, statement, {**params, "lo": lo}, lock_timeout_ms=policy.lock_timeout_ms)
        if not rows:
            chunks.append(_spec(tenants, lo, group.hi, max(remaining, 0), first_seq + len(chunks)))
            return chunks
        boundary = int(rows[0][0])
        chunks.append(_spec(tenants, lo, boundary, chunk_rows, first_seq + len(chunks)))
        remaining -= chunk_rows
        lo = boundary


def _spec(tenants: tuple[str, ...] | None, lo: int, hi: int, rows: int, seq: int) -> ChunkSpec:
    return ChunkSpec(key=chunk_key(tenants, lo, hi), lo=lo, hi=hi, tenants=tenants, seq=seq, rows_planned=rows)


@dataclass(frozen=True)
class Preview:
    """A plan computed without writing anything: what :func:`plan_run` would record."""

    run_key: str
    cutoff: datetime
    chunks: list[ChunkSpec]
    rows_planned: int
    chunk_rows: int
    tenant_groups: int
    null_timestamps: int
    partitions: list[PartitionDecision] = field(default_factory=list)
    tenant_cutoffs: TenantCutoffs | None = None
    sizing: ChunkSizing | None = None
    run_date: datetime | None = None  # the run's date, when known (recorded in the ledger beside the cutoff)
    # rows_planned is an estimate (a block sample of part of the table, a partition's statistics), not a
    # count: key groups, index-bounded block spans, a 100 % sample and a probe of an empty run count exactly.
    rows_estimated: bool = False


def compute_plan(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    *,
    max_chunks: int = 1024,
    target: TargetInfo | None = None,
    run_date: datetime | None = None,
) -> Preview:
    """Count the eligible rows and cut them into chunks; reads only (no ledger, no writes).

    :param run_date: the run's date, the cutoff frozen from it: per-tenant cutoffs are frozen from it.
        Without it a policy with per-tenant retention is planned only when the cutoff tells the date
        (:func:`~airflow_retention.core.planning.cutoff.resolve_run_date`)."""
    cutoff = as_utc(cutoff)
    if max_chunks < 1:
        raise PermanentError(f"max_chunks must be at least 1, got {max_chunks}")
    dbapi.prepare(conn)
    target = target or inspect_target(conn, policy)
    refuse_future_cutoff(conn, policy, cutoff)
    run_date = resolve_run_date(policy, cutoff, run_date)
    cutoffs = freeze_tenant_cutoffs(conn, policy, target, cutoff, run_date)
    preview = _compute(conn, policy, target, cutoffs, max_chunks)
    return dataclasses.replace(preview, tenant_cutoffs=cutoffs, run_date=run_date)


def freeze_tenant_cutoffs(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoff: datetime, run_date: datetime | None
) -> TenantCutoffs:
    """The run's per-tenant cutoffs (``tenant_retention``, ``tenant_retention_table``), each its tenant's
    retention before ``run_date``, the run's own date: never a date rebuilt from the cutoff when months
    make that ambiguous (:func:`~airflow_retention.core.planning.cutoff.require_run_date` refuses). A policy
    without per-tenant retention has the run's cutoff alone."""
    if policy.tenant_column is None or not (policy.tenant_retention or policy.tenant_retention_table is not None):
        return TenantCutoffs(cutoff)
    return tenants.compute(conn, policy, target, cutoff, require_run_date(policy, cutoff, run_date))


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


def nothing_eligible(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, *, null_tenants: bool = False
) -> str | None:
    """Why the run has nothing to delete, proven by one exact probe through an index on the timestamp
    column, or None: some row is eligible, the table (or one of its leaves) has no btree index led by
    the timestamp column, or the probe could not tell within :data:`EMPTY_PROBE_TIMEOUT_MS`.

    The probe is ``EXISTS`` over the predicate of every statement
    (:func:`~airflow_retention.core.sql.statements.eligibility`): each tenant against its own frozen cutoff,
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


def _empty_preview(
    conn: Any, policy: RetentionPolicy, cutoffs: TenantCutoffs, reason: str, blocks: int | None, max_chunks: int
) -> Preview:
    """The plan of a run proven empty by :func:`nothing_eligible`: no chunk, and why."""
    sized = size_chunks(policy, 0, blocks, None, max_chunks)
    sizing = dataclasses.replace(sized, chunks=0, seconds=0.0, reason=f"{reason}: 0 chunks")
    return Preview(
        run_key=run_key(policy, cutoffs.cutoff),
        cutoff=cutoffs.cutoff,
        chunks=[],
        rows_planned=0,
        chunk_rows=sizing.chunk_rows,
        tenant_groups=0,
        null_timestamps=warn_null_timestamps(conn, policy),
        sizing=sizing,
    )


def _compute(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    cutoff = cutoffs.cutoff
    if target.partitioned:
        return _plan_partitioned(conn, policy, target, cutoffs, max_chunks)
    if policy.expired_partitions != "delete":
        log.warning(
            "policy %s: expired_partitions %r has no effect: %s is not a partitioned table",
            policy.name,
            policy.expired_partitions,
            policy.table,
        )
    if policy.chunk_by == "block":
        return _plan_blocks(conn, policy, target, cutoffs, max_chunks)
    empty = nothing_eligible(conn, policy, target, cutoffs, null_tenants=True)
    if empty is not None:
        return _empty_preview(conn, policy, cutoffs, empty, None, max_chunks)
    groups = read_groups(conn, policy, target, cutoffs)
    null_timestamps = warn_null_timestamps(conn, policy)
    if len(groups) > 1:
        warn_interleaved_tenants(conn, policy)
    if math.ceil(len(groups) / MAX_TENANTS_PER_CHUNK) > max_chunks:
        log.warning(
            "policy %s: %d tenants have eligible rows, more than %d chunks of at most %d tenants can list;"
            " planning by key range across tenants instead (deletion is the same, per-tenant fairness is lost)",
            policy.name,
            len(groups),
            max_chunks,
            MAX_TENANTS_PER_CHUNK,
        )
        groups = [_merge(groups)]
    sizing = size_chunks(
        policy, sum(g.rows for g in groups), None, measured_rate(conn, policy, blocks=False), max_chunks
    )
    size = choose_chunk_rows(groups, sizing.chunk_rows, max_chunks)
    if size != sizing.chunk_rows:
        log.warning(
            "policy %s: %d eligible rows at chunk_rows=%d would need more than %d chunks (Airflow's [core]"
            " max_map_length); chunks grow to %d rows each",
            policy.name,
            sum(g.rows for g in groups),
            sizing.chunk_rows,
            max_chunks,
            size,
        )
    chunks = split(conn, policy, target, cutoffs, groups, size)
    return Preview(
        run_key=run_key(policy, cutoff),
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=sum(g.rows for g in groups),
        chunk_rows=size,
        tenant_groups=len(groups),
        null_timestamps=null_timestamps,
        sizing=sizing,
    )


def _plan_blocks(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    """Chunks of consecutive blocks holding about ``chunk_rows`` eligible rows each.

    By a repeatable sample, the chunks together cover every block of the table as it is now, so no
    eligible row is left out whatever the sample saw (blocks added later hold rows newer than the
    cutoff, or wait for the next run); ``rows_planned`` are estimates. Where the eligible rows are few
    and an index reaches them (:func:`index_bounded_blocks`), the chunks cover only the blocks that
    hold them, counted exactly: every row eligible when the plan is made, as one ``DELETE`` would see
    them."""
    cutoff = cutoffs.cutoff
    (blocks, reltuples, server) = dbapi.fetch_all(conn, BLOCK_COUNT, {"rel": policy.table.regclass_literal})[0]
    _require_tid_ranges(policy, server)
    empty = nothing_eligible(conn, policy, target, cutoffs)
    if empty is not None:
        return _empty_preview(conn, policy, cutoffs, empty, 0, max_chunks)
    blocks = int(blocks)
    percent, scale, sampled = sample_blocks(conn, policy, target, cutoffs, policy.table, reltuples)
    estimate = round(sum(n for _, n in sampled) * scale)
    rate = measured_rate(conn, policy, blocks=True)
    bps = rate.blocks_per_s if rate else None
    bounded = index_bounded_blocks(conn, policy, target, cutoffs, blocks, len(sampled) * scale, blocks_per_s=bps)
    ranges: list[tuple[int, int, int]] | None = None
    if bounded is not None:
        sizing = size_chunks(policy, bounded.rows, bounded.blocks, rate, max_chunks)
        size = max(sizing.chunk_rows, math.ceil(bounded.rows / max_chunks))
        ranges = bounded_ranges(bounded.spans, size)
        if len(ranges) > max_chunks:
            log.info(
                "policy %s: the eligible rows lie in %d separate block ranges, more than %d chunks: every block"
                " is planned",
                policy.name,
                len(ranges),
                max_chunks,
            )
            bounded = ranges = None
        else:
            why = sizing.reason if ranges else "nothing eligible: no chunk"
            sizing = dataclasses.replace(sizing, reason=f"{bounded.describe(blocks)}; {why}")
            log.info(
                "policy %s: %d block(s); %s: %d chunk(s) of block ranges",
                policy.name,
                blocks,
                bounded.describe(blocks),
                len(ranges),
            )
    if ranges is None:
        sizing = size_chunks(policy, estimate, blocks, rate, max_chunks)
        size = max(sizing.chunk_rows, math.ceil(estimate / max_chunks))
        ranges = block_ranges(sampled, scale, blocks, size, max_ranges=max_chunks)
        log.info(
            "policy %s: %d block(s); a %.2f %% sample estimates %d eligible row(s): %d chunk(s) of block ranges",
            policy.name,
            blocks,
            percent,
            estimate,
            len(ranges),
        )
    chunks = [_block_spec(lo, hi, rows, seq) for seq, (lo, hi, rows) in enumerate(ranges)]
    return Preview(
        run_key=run_key(policy, cutoff),
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=bounded.rows if bounded is not None else estimate,
        chunk_rows=size,
        tenant_groups=0,
        null_timestamps=warn_null_timestamps(conn, policy),
        sizing=sizing,
        # A 100 % sample reads every block: a count. No chunk: an empty table, nothing to estimate.
        rows_estimated=bounded is None and bool(chunks) and percent < 100.0,
    )


@dataclass(frozen=True)
class BoundedBlocks:
    """Where the eligible rows are, counted exactly.

    :param spans: ``(first block, end block, eligible rows)`` of each span of blocks holding eligible
        rows, in block order.
    :param blocks: the blocks a run reads: the spans and the gaps between them up to
        :data:`BOUNDED_GAP_BLOCKS` long.
    :param rows: the eligible rows.
    """

    spans: list[tuple[int, int, int]]
    blocks: int
    rows: int

    def describe(self, table_blocks: int) -> str:
        share = 100.0 * self.blocks / table_blocks if table_blocks else 0.0
        return (
            f"bounded by an index: {self.rows:,} eligible row(s) counted in {self.blocks:,} of {table_blocks:,}"
            f" block(s) ({share:.1f} %)"
        )


def index_bounded_blocks(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    blocks: int,
    sampled_blocks: float,
    relation: TableName | None = None,
    blocks_per_s: float | None = None,
) -> BoundedBlocks | None:
    """The exact map of the blocks holding eligible rows, or None when a plan over every block is the
    better one: a small table, eligible rows in more than :data:`BOUNDED_MAX_SHARE` of the sample's
    blocks or of the counted ones, no index the server would take (``EXPLAIN`` shows a sequential
    scan of the table) or a count that takes longer than :data:`BOUNDED_READ_SHARE` of a read of every
    block (at least :data:`BOUNDED_TIMEOUT_MS`).

    :param sampled_blocks: the sample's blocks holding eligible rows, scaled to the whole table.
    :param relation: a leaf partition to map instead of the policy's table.
    :param blocks_per_s: the policy's measured rate of block chunks (None: :data:`ASSUMED_BLOCKS_PER_S`).
    """
    relation = relation or policy.table
    if blocks < BOUNDED_MIN_BLOCKS or sampled_blocks > BOUNDED_MAX_SHARE * blocks:
        return None
    span = max(16, math.ceil(blocks / BOUNDED_MAX_SPANS))
    statement = eligible_spans_statement(policy, target, relation)
    params = {**cutoffs.params(), "span": span}
    full_read_ms = 1000.0 * blocks / (blocks_per_s or ASSUMED_BLOCKS_PER_S)
    timeout_ms = max(BOUNDED_TIMEOUT_MS, round(BOUNDED_READ_SHARE * full_read_ms))
    try:
        with dbapi.transaction(conn) as cur:
            dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, timeout_ms)
            cur.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            if _scans_sequentially(cur.fetchone()[0], relation.name):
                log.info(
                    "policy %s: the server would read all of %s to find the eligible rows (no index on %s it"
                    " would use): every block is planned",
                    policy.name,
                    relation,
                    policy.timestamp_column,
                )
                return None
            cur.execute(statement, params)
            counted = [(int(s), int(n)) for s, n in cur.fetchall()]
    except RetryableError as exc:
        if exc.sqlstate != "57014":
            raise
        log.warning(
            "policy %s: counting the eligible rows of %s through an index took over %d ms: every block is planned",
            policy.name,
            relation,
            timeout_ms,
        )
        return None
    spans = [(index * span, (index + 1) * span, n) for index, n in counted]
    # What the run reads: the ranges of a cut by gaps alone (a size above every row never cuts).
    covered = sum(hi - lo for lo, hi, _ in bounded_ranges(spans, sum(n for _, _, n in spans) + 1))
    if covered > BOUNDED_MAX_SHARE * blocks:
        log.info(
            "policy %s: eligible rows spread over %d of %d block(s) of %s: every block is planned",
            policy.name,
            covered,
            blocks,
            relation,
        )
        return None
    return BoundedBlocks(spans=spans, blocks=covered, rows=sum(n for _, _, n in spans))


def bounded_ranges(spans: list[tuple[int, int, int]], size: int) -> list[tuple[int, int, int]]:
    """Block ranges ``(lo, hi, eligible rows)`` of about ``size`` rows each over ``spans`` (from
    :func:`index_bounded_blocks`, in block order): a range ends where its rows reach ``size`` or where
    more than :data:`BOUNDED_GAP_BLOCKS` blocks without an eligible row follow, which no range covers."""
    ranges: list[tuple[int, int, int]] = []
    current: list[int] | None = None
    for start, end, n in spans:
        if current is not None and (start - current[1] > BOUNDED_GAP_BLOCKS or current[2] >= size):
            ranges.append((current[0], current[1], current[2]))
            current = None
        if current is None:
            current = [start, end, n]
        else:
            current[1], current[2] = end, current[2] + n
    if current is not None:
        ranges.append((current[0], current[1], current[2]))
    return ranges


def _scans_sequentially(plan: Any, table: str) -> bool:
    """Whether an ``EXPLAIN (FORMAT JSON)`` plan reads ``table`` with a (parallel) sequential scan."""
    nodes = json.loads(plan) if isinstance(plan, str) else plan
    stack = [node["Plan"] for node in nodes]
    while stack:
        node = stack.pop()
        if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") == table:
            return True
        stack.extend(node.get("Plans", []))
    return False


def _require_tid_ranges(policy: RetentionPolicy, server: int) -> None:
    if server < MIN_TID_RANGE_SERVER:
        raise PermanentError(
            f"policy {policy.name!r}: chunk_by 'block' needs PostgreSQL 14 or later (TID range scans);"
            f" this server is {server // 10000}: use chunk_by 'key'"
        )


def sample_blocks(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    relation: TableName,
    reltuples: float,
) -> tuple[float, float, list[tuple[int, int]]]:
    """Eligible rows per block of ``relation`` in a repeatable sample of about :data:`BLOCK_SAMPLE_ROWS`
    rows (all of a small or never analysed table): (percent sampled, scale to the whole, sample)."""
    percent = 100.0 if reltuples <= 0 else min(100.0, max(0.01, 100.0 * BLOCK_SAMPLE_ROWS / reltuples))
    sampled = dbapi.fetch_all(
        conn,
        block_sample_statement(policy, target, relation),
        {**cutoffs.params(), "percent": percent},
        lock_timeout_ms=policy.lock_timeout_ms,
    )
    return percent, 100.0 / percent, [(int(b), int(n)) for b, n in sampled]


def block_ranges(
    sampled: list[tuple[int, int]], scale: float, blocks: int, size: int, *, max_ranges: int | None = None
) -> list[tuple[int, int, int]]:
    """Consecutive block ranges (lo, hi, estimated eligible rows) of about ``size`` rows each by the
    sample, together covering blocks 0 to ``blocks``: no eligible row falls between two ranges.

    The last range runs from its first block to ``blocks``: the blocks after the last sampled eligible
    row join it rather than make a range of their own, which would be a chunk task (about half a second
    of Airflow's overhead) for rows the sample did not see, often none at all."""
    ranges: list[tuple[int, int, int]] = []
    lo, acc = 0, 0.0
    # The last sampled block inside the table as measured (a concurrent insert may have grown it since).
    last = max((i for i, (block, _) in enumerate(sampled) if block < blocks), default=-1)
    for i, (block, count) in enumerate(sampled):
        acc += count * scale
        # No cut at or after the last sampled block: what follows it has no sampled row to be a chunk for.
        if acc >= size and i < last and (max_ranges is None or len(ranges) + 1 < max_ranges):
            ranges.append((lo, block + 1, round(acc)))
            lo, acc = block + 1, 0.0
    if blocks > lo:
        ranges.append((lo, blocks, round(acc)))
    return ranges


def _block_spec(
    lo: int, hi: int, rows: int, seq: int, *, partition: TableName | None = None, partition_oid: int | None = None
) -> ChunkSpec:
    key = f"{BLOCK_CHUNK_PREFIX}{lo}-{hi}" + (f"@{partition}" if partition is not None else "")
    return ChunkSpec(
        key=key,
        lo=lo,
        hi=hi,
        tenants=None,
        seq=seq,
        rows_planned=rows,
        partition=str(partition) if partition is not None else None,
        partition_oid=partition_oid,
    )


def _plan_partitioned(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    """Partition chunks for the wholly expired partitions (``expired_partitions: detach | drop``), then
    block chunks per leaf for the rest (:mod:`partitions`)."""
    from airflow_retention.core.planning.partitions import fit, survey

    (server,) = dbapi.fetch_all(conn, "SELECT current_setting('server_version_num')::integer")[0]
    _require_tid_ranges(policy, server)
    # A policy that detaches or drops wholly expired partitions acts on an empty one too: only its survey
    # finds those, so it is planned as usual.
    if policy.expired_partitions == "delete" or policy.max_rows_per_tenant:
        empty = nothing_eligible(conn, policy, target, cutoffs)
        if empty is not None:
            return _empty_preview(conn, policy, cutoffs, empty, 0, max_chunks)
    rate = measured_rate(conn, policy, blocks=True)
    survey_ = survey(conn, policy, target, cutoffs, rate.blocks_per_s if rate else None)
    cutoff = cutoffs.cutoff
    actions = survey_.actions[:max_chunks]
    leaves = survey_.row_leaves
    budget = max_chunks - len(actions)
    if len(survey_.actions) > len(actions) or len(leaves) > budget:
        log.warning(
            "policy %s: %d partition(s) to %s and %d with rows to delete need more than %d chunks (Airflow's"
            " [core] max_map_length); the first %d of each are planned, the rest wait for the next run",
            policy.name,
            len(survey_.actions),
            policy.expired_partitions,
            len(leaves),
            max_chunks,
            max(budget, 0),
        )
        leaves = leaves[: max(budget, 0)]
    chunks: list[ChunkSpec] = []
    for unit in actions:
        rows = next(d.rows for d in survey_.decisions if d.relation.oid == unit.oid and d.action != "skip")
        chunks.append(
            ChunkSpec(
                key=f"{policy.expired_partitions}:{unit.table}",
                lo=0,
                hi=1,
                seq=len(chunks),
                rows_planned=rows,
                partition=str(unit.table),
                partition_oid=unit.oid,
                action=policy.expired_partitions,
            )
        )
    sizing = None
    if leaves:
        blocks = sum(leaf.blocks_to_read for leaf in leaves)
        rows = sum(leaf.estimate for leaf in leaves)
        sizing = size_chunks(policy, rows, blocks, rate, max(budget, 1))
    size, ranges = fit(leaves, sizing.chunk_rows, budget) if sizing else (policy.chunk_rows or 0, [])
    for leaf, leaf_ranges in zip(leaves, ranges, strict=True):
        for lo, hi, rows in leaf_ranges:
            chunks.append(
                _block_spec(lo, hi, rows, len(chunks), partition=leaf.relation.table, partition_oid=leaf.relation.oid)
            )
    decisions = [
        PartitionDecision(d.relation, d.action, d.rows, d.reason, chunks=_chunk_count(d, chunks))
        for d in survey_.decisions
    ]
    return Preview(
        run_key=run_key(policy, cutoff),
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=sum(c.rows_planned or 0 for c in chunks),
        chunk_rows=size,
        tenant_groups=0,
        null_timestamps=warn_null_timestamps(conn, policy),
        partitions=decisions,
        sizing=sizing,
        # A count only when every leaf was counted (through an index, or a 100 % sample) and its chunks
        # add up to that count; a whole partition's rows are its statistics' estimate.
        rows_estimated=bool(actions)
        or any(leaf.bounded is None and leaf.scale != 1.0 for leaf in leaves)
        or sum(c.rows_planned or 0 for c in chunks) != sum(leaf.estimate for leaf in leaves),
    )


def _chunk_count(decision: PartitionDecision, chunks: list[ChunkSpec]) -> int:
    return sum(1 for c in chunks if c.partition_oid == decision.relation.oid)


def plan_run(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    *,
    max_chunks: int = 1024,
    planned_by: str | None = None,
    target: TargetInfo | None = None,
    run_date: datetime | None = None,
) -> Plan:
    """Plan the run of ``policy`` at ``cutoff`` once; later calls for the same run key return the stored
    plan. Creates the ledger if needed and prunes the policy's runs older than ``ledger_keep_days``. A
    plan with no chunks records the run complete with zero rows. Per-tenant cutoffs are frozen from
    ``run_date`` (the date ``cutoff`` was frozen from; see :func:`compute_plan`) and recorded with the
    plan; the run's row records the date beside the cutoff."""
    cutoff = as_utc(cutoff)
    ledger = Ledger(policy.ledger_schema)
    dbapi.prepare(conn)
    # The target first: a policy pointed at the wrong database fails here and leaves no ledger schema behind.
    target = target or inspect_target(conn, policy)
    ledger.ensure(conn)
    key = run_key(policy, cutoff)
    stored = ledger.get_run(conn, key)
    if stored is not None:
        return _stored(conn, ledger, key, cutoff, stored)

    preview = compute_plan(conn, policy, cutoff, max_chunks=max_chunks, target=target, run_date=run_date)
    chunks, rows, size = preview.chunks, preview.rows_planned, preview.chunk_rows
    with dbapi.transaction(conn) as cur:
        created = ledger.register_run(
            cur,
            RunRecord.of(
                policy,
                key,
                cutoff,
                chunk_rows=size,
                chunks_expected=len(chunks),
                rows_planned=rows,
                planned_by=planned_by,
                run_date=preview.run_date,
            ),
        )
        if created:
            ledger.insert_chunks(cur, key, chunks)
            if preview.tenant_cutoffs is not None:
                ledger.record_tenant_cutoffs(cur, key, preview.tenant_cutoffs.overrides)
    if not created:  # another planner of the same run won the race: its plan is the plan
        stored = ledger.get_run(conn, key)
        assert stored is not None
        return _stored(conn, ledger, key, cutoff, stored)
    log.info(
        "policy %s: run %s planned %d chunk(s)%s, %s eligible rows, chunk_rows %d%s",
        policy.name,
        key,
        len(chunks),
        # Key chunks of a policy with tenants only: block chunks take every tenant's rows in one pass.
        f" over {preview.tenant_groups} tenant group(s)" if policy.tenant_column and preview.tenant_groups else "",
        f"~{rows}" if preview.rows_estimated else rows,  # "~": a sample's estimate (Preview.rows_estimated)
        size,
        f"; {preview.sizing.reason}" if preview.sizing else "",
    )
    pruned = ledger.prune(conn, policy.name, policy.ledger_keep_days)
    if pruned:
        log.info(
            "policy %s: pruned %d ledger run(s) last planned or completed more than %d days ago (ledger_keep_days)",
            policy.name,
            pruned,
            policy.ledger_keep_days,
        )
    return Plan(
        run_key=key,
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=rows,
        chunk_rows=size,
        reused=False,
        sizing=preview.sizing,
        rows_estimated=preview.rows_estimated,
    )


def _stored(conn: Any, ledger: Ledger, key: str, cutoff: datetime, run: dict[str, Any]) -> Plan:
    chunks = ledger.stored_plan(conn, key)
    log.info("run %s was planned before (%s): returning its %d stored chunk(s)", key, run["planned_at"], len(chunks))
    return Plan(
        run_key=key,
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=int(run["rows_planned"]),
        chunk_rows=int(run["chunk_rows"]),
        reused=True,
        # The ledger does not record how the rows were counted: key chunks always are (read_groups),
        # block and partition chunks may hold a sample's estimate.
        rows_estimated=any(c.key.startswith(BLOCK_CHUNK_PREFIX) or c.partition is not None for c in chunks),
    )
