"""Block chunks bounded by an index: where the sample finds the eligible rows few and an index reaches
them, the block walker counts them exactly per span of blocks and plans chunks over the spans that
hold them only, so that one day's rows do not cost a read of the whole table.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import RetryableError
from airflow_retention.core.planning.sizing import ASSUMED_BLOCKS_PER_S
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.reads import eligible_spans_statement
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


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
