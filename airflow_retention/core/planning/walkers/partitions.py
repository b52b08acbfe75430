"""The partition walker: a partitioned table planned as whole partitions to detach or drop
(``expired_partitions``) and block chunks over the leaves that keep some rows (:mod:`..partitions`
surveys the tree).
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import run_key
from airflow_retention.core.planning.partitions import fit, survey
from airflow_retention.core.planning.plans import Preview, empty_preview
from airflow_retention.core.planning.probes import nothing_eligible, warn_null_timestamps
from airflow_retention.core.planning.sizing import measured_rate, size_chunks
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.planning.tree import PartitionDecision
from airflow_retention.core.planning.walkers.blocks import block_spec, require_tid_ranges
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


def plan_partitioned(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    """Partition chunks for the wholly expired partitions (``expired_partitions: detach | drop``), then
    block chunks per leaf for the rest (:mod:`partitions`)."""

    (server,) = dbapi.fetch_all(conn, "SELECT current_setting('server_version_num')::integer")[0]
    require_tid_ranges(policy, server)
    # A policy that detaches or drops wholly expired partitions acts on an empty one too: only its survey
    # finds those, so it is planned as usual.
    if policy.expired_partitions == "delete" or policy.max_rows_per_tenant:
        empty = nothing_eligible(conn, policy, target, cutoffs)
        if empty is not None:
            return empty_preview(conn, policy, cutoffs, empty, 0, max_chunks)
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
                block_spec(lo, hi, rows, len(chunks), partition=leaf.relation.table, partition_oid=leaf.relation.oid)
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
