"""The records the ledger reads and writes, as plain data: a run (:class:`RunRecord`), a chunk of its plan
(:class:`ChunkSpec`) and its human label, who attempts a chunk (:class:`Attempt`), a tenant's dead letter
(:class:`DeadLetter`) and a policy's measured rate (:class:`MeasuredRate`). No SQL: the statements that
store them are in the other modules of this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_retention.core.policy.identifiers import TableName, display_name
from airflow_retention.core.policy.model import RetentionPolicy

# Chunk keys of policies with ``chunk_by: block`` start with this: their lo/hi are block numbers.
BLOCK_CHUNK_PREFIX = "blocks:"


@dataclass(frozen=True)
class Attempt:
    """Who is doing the work: recorded on the chunk that an attempt completes."""

    dag_id: str | None = None
    run_id: str | None = None
    map_index: int | None = None
    try_number: int | None = None
    host: str | None = None

    def label(self) -> str:
        if self.dag_id is None:
            return self.host or "outside Airflow"
        return f"{self.dag_id}/{self.run_id}/{self.map_index}/try {self.try_number}"


@dataclass(frozen=True)
class DeadLetter:
    """One tenant's rows of a chunk that failed for a reason a retry cannot fix (a foreign key, a
    privilege): the other tenants of the chunk are purged, this one is recorded and left."""

    tenant: str
    cutoff: datetime
    failure_class: str
    sqlstate: str | None
    message: str


@dataclass(frozen=True)
class MeasuredRate:
    """Rows (deleted, or matched in a dry run) and blocks (block chunks only) a policy's recent chunks
    went through, in ``seconds`` of their time."""

    chunks: int
    rows: int
    blocks: int | None
    seconds: float

    @property
    def rows_per_s(self) -> float | None:
        return self.rows / self.seconds if self.rows else None

    @property
    def blocks_per_s(self) -> float | None:
        return self.blocks / self.seconds if self.blocks else None


def half_open(lo: int, hi: int) -> str:
    """A range as people read it everywhere (chunk labels, batch log lines): ``[lo, hi)``, the numbers
    of the chunk key and of the range parameters, never an inclusive ``lo-(hi-1)`` beside a key that
    says ``lo-hi``."""
    return f"[{lo}, {hi})"


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a plan: tenants (None: all rows) and the key range [lo, hi)."""

    key: str
    lo: int
    hi: int
    tenants: tuple[str, ...] | None = None
    seq: int | None = None
    rows_planned: int | None = None
    partition: str | None = None
    partition_oid: int | None = None
    action: str | None = None

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> ChunkSpec:
        """The chunk a row of :meth:`Ledger.chunk_rows` describes (to label it as the UI does)."""
        tenants = row["tenants"]
        return cls(
            key=row["chunk_key"],
            lo=row["lo"],
            hi=row["hi"],
            tenants=tuple(tenants) if tenants is not None else None,
            seq=row.get("seq"),
            rows_planned=row.get("rows_planned"),
            partition=row.get("partition"),
            partition_oid=row.get("partition_oid"),
            action=row.get("action"),
        )

    def label(self) -> str:
        """The one human notation of a chunk's range in the Airflow UI (the mapped task's label), the
        logs, the CLI and the docs: "ids [1, 25655)", "tenant 7 · ids [120000, 130000)",
        "events_2026_05 · blocks [0, 8192)", "drop events_2026_04". The range is half-open, first
        bound in, second out, with the numbers of the chunk key ("blocks:0-8192"), which is the ledger's
        identifier and is never reformatted, and of ``keys=(lo, hi)`` and ``blocks=(lo, hi)``."""
        leaf = TableName.parse(self.partition).name if self.partition else None
        if self.action is not None:
            return f"{self.action} {display_name(leaf or '?')}"
        if self.key.startswith(BLOCK_CHUNK_PREFIX) or self.partition is not None:
            blocks = f"blocks {half_open(self.lo, self.hi)}"
            return f"{display_name(leaf)} · {blocks}" if leaf else blocks
        ids = f"ids {half_open(self.lo, self.hi)}"
        if self.tenants is None:
            return ids
        if len(self.tenants) == 1:
            return f"tenant {self.tenants[0]} · {ids}"
        return f"{len(self.tenants)} tenants {self.tenants[0]}…{self.tenants[-1]} · {ids}"


@dataclass(frozen=True)
class RunRecord:
    run_key: str
    policy: str
    target_table: str
    cutoff: datetime
    dry_run: bool
    chunk_rows: int
    batch_size: int
    chunks_expected: int
    rows_planned: int
    planned_by: str | None
    run_date: datetime | None = None  # the run's date, the cutoff frozen from it; None when not known
    # A partitioned table's leaves with eligible rows that the plan left out (past the chunk budget);
    # None where that does not apply (a table that is not partitioned, a lone chunk's run).
    leaves_deferred: tuple[str, ...] | None = None

    @classmethod
    def of(
        cls,
        policy: RetentionPolicy,
        run_key: str,
        cutoff: datetime,
        *,
        chunk_rows: int,
        chunks_expected: int,
        rows_planned: int,
        planned_by: str | None,
        run_date: datetime | None = None,
        leaves_deferred: tuple[str, ...] | None = None,
    ) -> RunRecord:
        return cls(
            run_key=run_key,
            policy=policy.name,
            target_table=str(policy.table),
            cutoff=cutoff,
            dry_run=policy.dry_run,
            chunk_rows=chunk_rows,
            batch_size=policy.batch_size,
            chunks_expected=chunks_expected,
            rows_planned=rows_planned,
            planned_by=planned_by,
            run_date=run_date,
            leaves_deferred=leaves_deferred,
        )
