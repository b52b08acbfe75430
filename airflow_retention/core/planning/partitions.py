"""Planning a partitioned table: block chunks per leaf, and whole expired partitions as one chunk each.

The planner reads the partition tree (multi-level; RANGE, LIST and HASH; a DEFAULT partition; a
partition left pending by an interrupted ``DETACH … CONCURRENTLY``) and decides, per partition:

- a partition whose RANGE bound on the policy's timestamp column starts at or after the cutoff holds
  no eligible row: **skip**;
- a partition whose RANGE bound on the timestamp column (its own or an ancestor's) ends at or before
  the cutoff holds only rows expired by time: with ``expired_partitions: detach`` or ``drop`` it is one
  **partition chunk** (``core/running/detach.py``) — the highest such partition below the table, so a wholly
  expired month that is itself sub-partitioned is detached once. With a ``condition``, only when a
  check proves that no row of it is kept by the condition, nor lacks a tenant with a ``tenant_column``
  (checked again under lock when it runs);
- every other leaf is cut into **block chunks** of its own (TID range scans run on the leaf itself),
  from a sample of its blocks; a leaf whose sample finds nothing is probed once for any eligible row
  and skipped when it has none.

Leaves attached after planning wait for the next run; a leaf detached or dropped before its chunk
runs completes that chunk with 0 rows (``core/running/engine.py``). More leaves with rows than the chunk
budget: the walker plans those least recently covered by the policy's runs and records the others as
deferred (``walkers/partitions.py``, ``carry_over``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi, partman
from airflow_retention.core.db.catalog import check_detached_schema, require_privileges
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.planning.tree import PartitionDecision, Relation, read_tree
from airflow_retention.core.planning.walkers.blocks import block_ranges, sample_blocks
from airflow_retention.core.planning.walkers.spans import BoundedBlocks, bounded_ranges, index_bounded_blocks
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import PARTITION_BOUNDS
from airflow_retention.core.sql.partitions import bound_check_statement, ineligible_exists_statement
from airflow_retention.core.sql.reads import eligible_exists_statement
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)

_RANGE_BOUND = re.compile(r"^FOR VALUES FROM \((?P<lo>.*)\) TO \((?P<hi>.*)\)$", re.S)


def _literal(text: str) -> str | None:
    """A bound value as text: ``'2026-01-01 00:00:00+00'`` → the timestamp; MINVALUE/MAXVALUE → None."""
    text = text.strip()
    if len(text) >= 2 and text[0] == "'" and text[-1] == "'":
        return text[1:-1].replace("''", "'")
    return None


def time_bounds(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, tree: dict[int, Relation]
) -> dict[int, tuple[bool, bool]]:
    """Per relation below the root: (newer, expired) from its own RANGE bound on the timestamp column;
    (False, False) where its parent is not RANGE-partitioned on that column alone. With per-tenant
    cutoffs, "newer" is after the latest of them and "expired" before the earliest."""
    candidates: list[tuple[int, str | None, str | None]] = []
    for rel in tree.values():
        parent = tree.get(rel.parent) if rel.parent is not None else None
        if parent is None or rel.bound is None:
            continue
        if parent.strategy != "r" or parent.key_column != policy.timestamp_column:
            continue
        match = _RANGE_BOUND.match(rel.bound)
        if match is None:
            continue
        candidates.append((rel.oid, _literal(match["lo"]), _literal(match["hi"])))
    flags: dict[int, tuple[bool, bool]] = {oid: (False, False) for oid in tree}
    if candidates:
        rows = dbapi.fetch_all(
            conn,
            bound_check_statement(target),
            {
                "newer_from": cutoffs.latest,
                "expired_by": cutoffs.earliest,
                "lows": [c[1] for c in candidates],
                "highs": [c[2] for c in candidates],
            },
        )
        for (oid, _, _), (newer, expired) in zip(candidates, rows, strict=True):
            flags[oid] = (bool(newer), bool(expired))
    return flags


def expired_by_bound(cur: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, oid: int) -> bool:
    """Whether the catalog proves now, in the caller's transaction, that every row of the partition
    ``oid`` is expired by time at the run's frozen cutoff (the earliest tenant's): its own RANGE bound on
    the timestamp column, or an ancestor's below the policy's table, ends at or before it. A partition
    chunk checks this when it runs, whatever the plan said: a partition re-attached with another bound,
    or named by hand in a lone chunk, is never removed on the planner's word. False for a DEFAULT
    partition, LIST and HASH bounds alone, and a relation that is no partition (any more)."""
    cur.execute(PARTITION_BOUNDS, {"oid": oid, "root": policy.table.regclass_literal})
    lows, highs = [], []
    for bound, strategy, key_column in cur.fetchall():
        match = _RANGE_BOUND.match(bound or "")
        if strategy == "r" and key_column == policy.timestamp_column and match is not None:
            lows.append(_literal(match["lo"]))
            highs.append(_literal(match["hi"]))
    if not highs:
        return False
    cur.execute(
        bound_check_statement(target),
        {"newer_from": cutoffs.latest, "expired_by": cutoffs.earliest, "lows": lows, "highs": highs},
    )
    return any(bool(expired) for _, expired in cur.fetchall())


def _chain(tree: dict[int, Relation], rel: Relation) -> list[Relation]:
    """The relation and its ancestors below the root, the relation first."""
    out = []
    while rel.parent is not None:
        out.append(rel)
        rel = tree[rel.parent]
    return out


@dataclass(frozen=True)
class RowLeaf:
    """A leaf whose eligible rows are deleted in block chunks: its sample and estimate."""

    relation: Relation
    sampled: list[tuple[int, int]]
    scale: float
    estimate: int
    # The exact map of its eligible rows, when an index bounds them (planner.index_bounded_blocks).
    bounded: BoundedBlocks | None = None

    @property
    def blocks_to_read(self) -> int:
        return self.bounded.blocks if self.bounded is not None else int(self.relation.blocks or 0)


@dataclass(frozen=True)
class PartitionPlan:
    """The planner's reading of a partitioned table: partition chunks, leaves to cut, decisions."""

    actions: list[Relation]  # whole partitions to detach or drop, in order
    row_leaves: list[RowLeaf]
    decisions: list[PartitionDecision]


def survey(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    blocks_per_s: float | None = None,
) -> PartitionPlan:
    """Read the tree and decide what becomes of each partition (nothing is written).

    :param blocks_per_s: the policy's measured rate of block chunks (timing the leaves' exact counts).
    """
    tree = read_tree(conn, policy)
    flags = time_bounds(conn, policy, target, cutoffs, tree)
    # A tenant cap counts deleted rows per tenant: whole partitions would go past it uncounted.
    acting = policy.expired_partitions in ("detach", "drop") and not policy.max_rows_per_tenant
    if policy.expired_partitions != "delete" and not acting:
        log.warning(
            "policy %s: max_rows_per_tenant is set: expired partitions are purged row by row, not %s whole",
            policy.name,
            "dropped" if policy.expired_partitions == "drop" else "detached",
        )
    decisions: list[PartitionDecision] = []
    actions: dict[int, Relation] = {}
    row_leaves: list[RowLeaf] = []
    not_whole: set[int] = set()  # wholly expired, yet purged row by row (a row is kept, or a pending detach)
    for leaf in (r for r in tree.values() if r.kind in ("r", "f") and r.parent is not None):
        chain = _chain(tree, leaf)
        pending = next((r for r in chain if r.pending_detach and not tree[r.parent].pending_detach), None)
        if any(flags[r.oid][0] for r in chain):
            decisions.append(PartitionDecision(leaf, "skip", 0, "its range starts at or after the cutoff"))
            continue
        expired = [r for r in chain if flags[r.oid][1]]
        unit = expired[-1] if expired else None  # the highest wholly expired partition
        if acting and unit is not None and unit.oid not in not_whole:
            if unit.oid in actions:
                continue
            _require_ownership(conn, policy, tree, unit)
            if needs_row_check(policy) and unit.pending_detach:
                # Someone else's interrupted detach: not this policy's to finish without checking its rows
                # under lock, which a pending partition no longer allows.
                not_whole.add(unit.oid)
            elif needs_row_check(policy) and _holds_kept_rows(conn, policy, target, cutoffs, unit):
                not_whole.add(unit.oid)
                log.info(
                    "policy %s: partition %s is wholly expired but holds rows the condition keeps: its eligible"
                    " rows are deleted in batches and it stays",
                    policy.name,
                    unit.table,
                )
            else:
                actions[unit.oid] = unit
                rows = sum(r.rows_estimate for r in tree.values() if r.kind == "r" and unit in _chain(tree, r))
                reason = "wholly expired" + (" (pending detach: finalized)" if unit.pending_detach else "")
                decisions.append(PartitionDecision(unit, policy.expired_partitions, rows, reason, chunks=1))
                continue
        if pending is not None:
            log.warning(
                "policy %s: partition %s of %s is pending detach (an interrupted DETACH PARTITION … CONCURRENTLY):"
                " its rows are no longer part of the table and are not purged; finish it with ALTER TABLE %s"
                " DETACH PARTITION %s FINALIZE (docs/runbook.md)",
                policy.name,
                pending.table,
                policy.table,
                tree[pending.parent].table.sql if pending.parent is not None else policy.table.sql,
                pending.table.sql,
            )
            decisions.append(PartitionDecision(leaf, "skip", 0, f"pending detach ({pending.table})"))
            continue
        if leaf.kind == "f":
            log.warning("policy %s: foreign partition %s is not purged (no TID range scans)", policy.name, leaf.table)
            decisions.append(PartitionDecision(leaf, "skip", 0, "foreign table"))
            continue
        if not leaf.blocks:
            decisions.append(PartitionDecision(leaf, "skip", 0, "empty"))
            continue
        kept = unit is not None and acting  # wholly expired, yet purged row by row
        row_leaf, decision = _leaf_rows(conn, policy, target, cutoffs, leaf, kept, blocks_per_s)
        decisions.append(decision)
        if row_leaf is not None:
            row_leaves.append(row_leaf)
    plan = PartitionPlan(actions=list(actions.values()), row_leaves=row_leaves, decisions=decisions)
    if plan.actions and not policy.dry_run:
        check_detached_schema(conn, policy)
    if acting:
        partman.check_plan(conn, policy, [r.table for r in plan.actions])
    log.info(
        "policy %s: %s has %d leaf partition(s): %d to %s whole, %d with rows to delete, %d skipped",
        policy.name,
        policy.table,
        sum(1 for r in tree.values() if r.kind in ("r", "f") and r.parent is not None),
        len(plan.actions),
        policy.expired_partitions,
        len(row_leaves),
        sum(1 for d in decisions if d.action == "skip"),
    )
    return plan


def _leaf_rows(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    leaf: Relation,
    kept: bool,
    blocks_per_s: float | None,
) -> tuple[RowLeaf | None, PartitionDecision]:
    """A leaf whose rows are deleted in batches: where its eligible rows are (an exact count through an
    index, else a sample; a sample that finds none is checked by one probe), or a skip when it has none.
    ``kept``: a wholly expired partition that stays for the rows it keeps."""
    require_privileges(conn, policy, leaf.table, ("SELECT",) if policy.dry_run else ("SELECT", "DELETE"))
    percent, scale, sampled = sample_blocks(conn, policy, target, cutoffs, leaf.table, leaf.reltuples)
    estimate = round(sum(n for _, n in sampled) * scale)
    blocks = int(leaf.blocks)
    bounded = index_bounded_blocks(
        conn, policy, target, cutoffs, blocks, len(sampled) * scale, leaf.table, blocks_per_s=blocks_per_s
    )
    if bounded is not None:
        if bounded.rows == 0:
            return None, PartitionDecision(leaf, "skip", 0, "no eligible row")
        row_leaf = RowLeaf(leaf, sampled, scale, bounded.rows, bounded)
        return row_leaf, PartitionDecision(leaf, "delete rows", bounded.rows, bounded.describe(blocks))
    if estimate == 0:
        probe = dbapi.fetch_all(
            conn,
            eligible_exists_statement(policy, target, leaf.table),
            cutoffs.params(),
            lock_timeout_ms=policy.lock_timeout_ms,
        )
        if not probe[0][0]:
            return None, PartitionDecision(leaf, "skip", 0, "no eligible row")
        estimate = 1
    why = "wholly expired, kept rows" if kept else f"{percent:.2f} % sample"
    return RowLeaf(leaf, sampled, scale, estimate), PartitionDecision(leaf, "delete rows", estimate, why)


def needs_row_check(policy: RetentionPolicy) -> bool:
    """Whether time alone cannot prove a wholly expired partition's rows all eligible: a condition may keep
    some, and with a tenant column a row without a tenant is never eligible."""
    return bool(policy.condition) or policy.tenant_column is not None


def _holds_kept_rows(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, unit: Relation
) -> bool:
    rows = dbapi.fetch_all(
        conn,
        ineligible_exists_statement(policy, target, unit.table),
        cutoffs.params(),
        lock_timeout_ms=policy.lock_timeout_ms,
    )
    return bool(rows[0][0])


def _require_ownership(conn: Any, policy: RetentionPolicy, tree: dict[int, Relation], unit: Relation) -> None:
    """DETACH and DROP need to own the partition and its parent (PostgreSQL 15); a dry run only reads.
    Rows of a leaf are deleted on the leaf itself, so the leaf's own grants count, not the parent's:
    the caller checks those before sampling it."""
    if policy.dry_run:
        require_privileges(conn, policy, unit.table, ("SELECT",))
        return
    require_privileges(conn, policy, unit.table, ("ownership",))
    if unit.parent is not None:
        require_privileges(conn, policy, tree[unit.parent].table, ("ownership",))


def split_leaves(leaves: Iterable[RowLeaf], size: int) -> list[list[tuple[int, int, int]]]:
    """Block ranges (lo, hi, estimated rows) of each leaf at ``size`` estimated rows per chunk."""
    return [
        bounded_ranges(leaf.bounded.spans, size)
        if leaf.bounded is not None
        else block_ranges(leaf.sampled, leaf.scale, int(leaf.relation.blocks or 0), size)
        for leaf in leaves
    ]


def fit(leaves: list[RowLeaf], chunk_rows: int, budget: int) -> tuple[int, list[list[tuple[int, int, int]]]]:
    """The smallest chunk size from ``chunk_rows`` up whose block chunks of every leaf fit ``budget``
    (the caller keeps the leaves at most ``budget``: one chunk each always fits)."""
    total = sum(leaf.estimate for leaf in leaves)
    size = max(chunk_rows, math.ceil(total / max(budget, 1)) if total else chunk_rows)
    while True:
        ranges = split_leaves(leaves, size)
        if sum(len(r) for r in ranges) <= budget:
            return size, ranges
        if size > total and any(leaf.bounded is not None for leaf in leaves):
            # The runs of an index-bounded leaf far apart stay separate chunks however large chunks get:
            # past one chunk's worth of every row, plan those leaves over every block instead.
            log.info(
                "%d chunk(s) of index-bounded block ranges exceed the %d left: every block of each leaf is planned",
                sum(len(r) for r in ranges),
                budget,
            )
            leaves = [dataclasses.replace(leaf, bounded=None) for leaf in leaves]
            continue
        size = math.ceil(size * 1.25)
