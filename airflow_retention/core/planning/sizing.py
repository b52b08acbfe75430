"""How many chunks a run gets: the estimate of its work (rows and blocks at the policy's measured
rates, else assumed ones) and the choice of a chunk count from it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import MeasuredRate
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)


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
