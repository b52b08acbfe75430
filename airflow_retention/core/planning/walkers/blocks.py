"""The block walker: chunks of consecutive blocks of a table or of one leaf partition, planned from a
repeatable sample (or from the index-bounded spans of :mod:`.spans`), and batches of about ``n`` rows'
worth of blocks, read by TID range scans.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import BLOCK_CHUNK_PREFIX, ChunkSpec
from airflow_retention.core.planning.cutoff import run_key
from airflow_retention.core.planning.plans import Preview, empty_preview
from airflow_retention.core.planning.probes import nothing_eligible, warn_null_timestamps
from airflow_retention.core.planning.sizing import measured_rate, size_chunks
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.planning.walkers.base import Batch, Position, Walker
from airflow_retention.core.planning.walkers.spans import bounded_ranges, index_bounded_blocks
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import BLOCK_COUNT
from airflow_retention.core.sql.reads import block_sample_statement
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


# The block planner samples about this many rows (all of a smaller table) to find the eligible ones.
BLOCK_SAMPLE_ROWS = 30_000
MIN_TID_RANGE_SERVER = 140000


def require_tid_ranges(policy: RetentionPolicy, server: int) -> None:
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


def block_spec(
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


def plan_blocks(
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
    require_tid_ranges(policy, server)
    empty = nothing_eligible(conn, policy, target, cutoffs)
    if empty is not None:
        return empty_preview(conn, policy, cutoffs, empty, 0, max_chunks)
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
    chunks = [block_spec(lo, hi, rows, seq) for seq, (lo, hi, rows) in enumerate(ranges)]
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


def block_extent(conn: Any, relation: TableName) -> tuple[int, float]:
    """The relation's size in blocks now, and its rows per block by the server's estimate (to turn a
    batch size into blocks)."""
    blocks, reltuples, _ = dbapi.fetch_all(conn, BLOCK_COUNT, {"rel": relation.regclass_literal})[0]
    if not blocks or reltuples is None or reltuples <= 0:
        return int(blocks or 0), 50.0  # never analysed: a guess, corrected by the adaptive batch size
    return int(blocks), max(1.0, float(reltuples) / float(blocks))


class BlockWalker(Walker):
    """Batches of consecutive blocks of a table or of one leaf partition, as many as hold about ``size``
    rows each; the statement reads them by a TID range scan."""

    unit = "blocks"

    def __init__(self, chunk: ChunkSpec, relation: TableName, *, leaf: bool = False) -> None:
        super().__init__(chunk)
        self.relation, self.leaf = relation, leaf
        self.end, self.rows_per_block = chunk.hi, 1.0

    def open(self, conn: Any) -> None:
        try:
            blocks, self.rows_per_block = block_extent(conn, self.relation)
        except PermanentError:
            if not self.leaf:
                raise
            blocks, self.rows_per_block = self.chunk.hi, 50.0  # the leaf is gone: its first batch says so
        # Blocks past the table's end when the chunk starts hold no row yet: a range that runs past it
        # (a lone chunk given 0 to 2**62, a table truncated by VACUUM since planning) stops there.
        self.end = min(self.chunk.hi, blocks)

    def next_batch(self, cur: Any, at: Position, size: int) -> Batch:
        upper = max(at.key, min(self.end, at.key + max(1, round(size / self.rows_per_block))))
        params = {"lo_tid": f"({at.key},0)", "hi_tid": f"({upper},0)"}
        return Batch(lo=at.key, hi=upper, full=upper < self.end, params=params)
