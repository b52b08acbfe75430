"""A partitioned table's tree as the catalog describes it at planning, and what a plan decides for each
partition (:mod:`.partitions` decides; the CLI's plan preview shows the decisions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.catalog import PARTITION_TREE


@dataclass(frozen=True)
class Relation:
    """One relation of a partitioned table's tree, as the catalog describes it at planning."""

    oid: int
    parent: int | None
    level: int
    pending_detach: bool
    kind: str  # 'r' table, 'p' partitioned, 'f' foreign
    table: TableName
    bound: str | None
    blocks: int | None
    reltuples: float
    strategy: str | None  # of a partitioned relation: 'r' range, 'l' list, 'h' hash
    key_column: str | None

    @property
    def rows_estimate(self) -> int:
        return max(0, round(self.reltuples))


@dataclass(frozen=True)
class PartitionDecision:
    """What the plan does with one partition: the CLI's plan preview shows these."""

    relation: Relation
    action: str  # 'drop', 'detach', 'delete rows', 'skip'
    rows: int  # estimated rows (partition chunks: the whole partition; delete rows: the eligible ones)
    reason: str
    chunks: int = 0


def read_tree(conn: Any, policy: RetentionPolicy) -> dict[int, Relation]:
    rows = dbapi.fetch_all(
        conn, PARTITION_TREE, {"rel": policy.table.regclass_literal}, lock_timeout_ms=policy.lock_timeout_ms
    )
    tree = {}
    for oid, parent, level, pending, kind, schema, name, bound, blocks, reltuples, strategy, key in rows:
        tree[int(oid)] = Relation(
            oid=int(oid),
            parent=int(parent) if parent is not None else None,
            level=int(level),
            pending_detach=bool(pending),
            kind=kind,
            table=TableName(schema, name),
            bound=bound,
            blocks=int(blocks) if blocks is not None else None,
            reltuples=float(reltuples or 0.0),
            strategy=strategy,
            key_column=key,
        )
    return tree
