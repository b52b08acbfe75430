"""What planning produces: a :class:`Preview` (computed, nothing written) and a :class:`Plan` (recorded
in the ledger, what the chunk tasks are mapped over).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import (
    format_cutoff,
    run_key,
)
from airflow_retention.core.planning.probes import warn_null_timestamps
from airflow_retention.core.planning.sizing import ChunkSizing, size_chunks
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.planning.tree import PartitionDecision
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)


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
    # A partitioned table's leaves with eligible rows left for later runs (past the chunk budget), by
    # name; None for a table that is not partitioned (recorded in the ledger as runs.leaves_deferred).
    leaves_deferred: tuple[str, ...] | None = None


def empty_preview(
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
