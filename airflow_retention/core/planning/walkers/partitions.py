"""The partition walker: a partitioned table planned as whole partitions to detach or drop
(``expired_partitions``) and block chunks over the leaves that keep some rows (:mod:`..partitions`
surveys the tree). Leaves past the chunk budget are carried over to later runs, least recently covered
first (:func:`carry_over`), and the plan names them (``Preview.leaves_deferred``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import run_key
from airflow_retention.core.planning.partitions import PartitionPlan, RowLeaf, fit, survey
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
            return dataclasses.replace(empty_preview(conn, policy, cutoffs, empty, 0, max_chunks), leaves_deferred=())
    rate = measured_rate(conn, policy, blocks=True)
    survey_ = survey(conn, policy, target, cutoffs, rate.blocks_per_s if rate else None)
    cutoff = cutoffs.cutoff
    actions = survey_.actions[:max_chunks]
    budget = max_chunks - len(actions)
    leaves, deferred = carry_over(conn, policy, survey_.row_leaves, budget)
    if len(survey_.actions) > len(actions) or deferred:
        _warn_budget(policy, survey_, len(actions), leaves, deferred, max_chunks)
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
    left_out = {leaf.relation.oid for leaf in deferred}
    decisions = [
        PartitionDecision(
            d.relation,
            d.action,
            d.rows,
            f"{d.reason}; deferred past the chunk budget: a later run plans it first"
            if d.relation.oid in left_out
            else d.reason,
            chunks=_chunk_count(d, chunks),
        )
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
        leaves_deferred=tuple(str(leaf.relation.table) for leaf in deferred),
        # A count only when every leaf was counted (through an index, or a 100 % sample) and its chunks
        # add up to that count; a whole partition's rows are its statistics' estimate.
        rows_estimated=bool(actions)
        or any(leaf.bounded is None and leaf.scale != 1.0 for leaf in leaves)
        or sum(c.rows_planned or 0 for c in chunks) != sum(leaf.estimate for leaf in leaves),
    )


def carry_over(
    conn: Any, policy: RetentionPolicy, leaves: list[RowLeaf], budget: int
) -> tuple[list[RowLeaf], list[RowLeaf]]:
    """The leaves with rows to delete that this run plans, and those it leaves to later runs when they
    are more than ``budget``, both in the tree's order.

    The planned ones are the leaves least recently covered by the policy's earlier runs (the ledger's
    :meth:`~airflow_retention.core.ledger.history.LedgerHistory.leaf_coverage`): first those no run
    covered, then by the cutoff of their latest covering run, ties in the tree's order. A fixed order
    would take the same first leaves every night while the others (hash and list leaves keep getting
    rows) are never purged; so, with the same leaves, every one is covered within
    ``ceil(leaves / budget)`` runs. Reads the ledger only then, and only reads it (the plan preview too).
    """
    if len(leaves) <= budget:
        return leaves, []
    covered = Ledger(policy.ledger_schema).leaf_coverage(
        conn, policy.name, dry_run=policy.dry_run, oids=[leaf.relation.oid for leaf in leaves]
    )

    def staleness(i: int) -> tuple[Any, ...]:
        last = covered.get(leaves[i].relation.oid)
        return (0, i) if last is None else (1, last, i)

    chosen = set(sorted(range(len(leaves)), key=staleness)[: max(budget, 0)])
    return [leaf for i, leaf in enumerate(leaves) if i in chosen], [
        leaf for i, leaf in enumerate(leaves) if i not in chosen
    ]


def _warn_budget(
    policy: RetentionPolicy,
    survey_: PartitionPlan,
    planned_actions: int,
    leaves: list[RowLeaf],
    deferred: list[RowLeaf],
    max_chunks: int,
) -> None:
    """Say what does not fit the chunk budget and what becomes of it."""
    if len(survey_.actions) > planned_actions:
        # A whole partition planned is gone after its run: the next run's survey starts with the others.
        log.warning(
            "policy %s: %d partition(s) to %s need more than the %d chunks of Airflow's [core] max_map_length:"
            " the first %d are planned, the next runs plan the other %d",
            policy.name,
            len(survey_.actions),
            policy.expired_partitions,
            max_chunks,
            planned_actions,
            len(survey_.actions) - planned_actions,
        )
    if deferred:
        log.warning(
            "policy %s: %d leaf partition(s) have rows to delete, and %d of the %d chunks of Airflow's [core]"
            " max_map_length are left for them: this run plans the %d least recently purged by the policy's"
            " runs (%s) and does not cover %d (%s); its verify says so, and the next run plans those first",
            policy.name,
            len(leaves) + len(deferred),
            max(max_chunks - planned_actions, 0),
            max_chunks,
            len(leaves),
            _names(leaves),
            len(deferred),
            _names(deferred),
        )


def _names(leaves: list[RowLeaf], shown: int = 20) -> str:
    names = ", ".join(str(leaf.relation.table) for leaf in leaves[:shown])
    return f"{names} … ({len(leaves) - shown} more)" if len(leaves) > shown else names or "none"


def _chunk_count(decision: PartitionDecision, chunks: list[ChunkSpec]) -> int:
    return sum(1 for c in chunks if c.partition_oid == decision.relation.oid)
