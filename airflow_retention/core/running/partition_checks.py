"""What a partition chunk reads before it acts, each time it runs: the partition's state in the catalog
(found by the oid recorded at planning) and why a planned leaf is gone, the action the policy as it is
now still allows, and the census of the partition's rows (all, those the policy keeps, per tenant) in one
scan. Nothing here writes; :mod:`~airflow_retention.core.running.detach` acts on what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import PARTITION_STATE
from airflow_retention.core.sql.partitions import partition_census_statement
from airflow_retention.core.sql.target import TargetInfo


@dataclass(frozen=True)
class PartitionState:
    """A partition as the catalog shows it now (found by the oid recorded at planning)."""

    table: TableName
    parent_oid: int | None
    parent: TableName | None
    pending_detach: bool
    parent_has_default: bool
    in_table: bool  # still a partition of the policy's table (directly or below)

    @property
    def attached(self) -> bool:
        return self.parent_oid is not None


def partition_state(cur: Any, policy: RetentionPolicy, oid: int) -> PartitionState | None:
    """The partition's state now, or None when no relation has that oid any more (dropped)."""
    cur.execute(PARTITION_STATE, {"oid": oid, "root": policy.table.regclass_literal})
    row = cur.fetchone()
    if row is None:
        return None
    schema, name, parent_oid, parent_schema, parent_name, pending, has_default, in_table = row
    return PartitionState(
        table=TableName(schema, name),
        parent_oid=int(parent_oid) if parent_oid is not None else None,
        parent=TableName(parent_schema, parent_name) if parent_oid is not None else None,
        pending_detach=bool(pending),
        parent_has_default=bool(has_default),
        in_table=bool(in_table),
    )


def gone_reason(state: PartitionState | None, planned: TableName) -> str | None:
    """Why a leaf planned for block chunks can no longer be purged through the policy's table, if so."""
    if state is None:
        return "was dropped"
    if state.table != planned:
        return f"was renamed to {state.table}"
    if not state.attached or not state.in_table:
        return "was detached"
    if state.pending_detach:
        return "is being detached (pending detach)"
    return None


def wanted_action(policy: RetentionPolicy, planned: str) -> tuple[str | None, str]:
    """What a partition chunk may do when it runs: never more than both its plan and the policy as it is
    now allow (``drop`` only when both drop; ``detach`` when either detaches), and nothing when the policy
    no longer removes partitions whole. Returns the action (None: keep the partition) and, when the
    policy changed since planning, why the chunk does less than planned."""
    now = policy.expired_partitions
    if now not in ("detach", "drop"):
        return None, (
            f"the policy's expired_partitions is {now!r} now (planned: {planned}): nothing is removed whole,"
            " its eligible rows are deleted in batches by the next run"
        )
    if policy.max_rows_per_tenant:
        return None, (
            "the policy caps rows per tenant now (max_rows_per_tenant): its eligible rows are deleted in batches"
            " by the next run"
        )
    if planned == "drop" and now == "drop":
        return "drop", ""
    if planned == "drop":
        return "detach", "planned to drop it, the policy detaches now: detached, not dropped"
    return "detach", ""


@dataclass(frozen=True)
class Census:
    """A partition's rows, counted in one scan: all of them, those the policy keeps, and per tenant."""

    rows: int
    kept: int
    tenants: list[tuple[str, int]]


def census(cur: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, table: TableName) -> Census:
    cur.execute(partition_census_statement(policy, target, table), cutoffs.params())
    found = cur.fetchall()
    return Census(
        rows=sum(int(n) for _, n, _ in found),
        kept=sum(int(k) for _, _, k in found),
        tenants=[(str(t), int(n)) for t, n, _ in found if t is not None and n],
    )
