"""What one attempt at a chunk works with and what it reports: the chunk's context, shared by the
engine's loop and the progress it records (:mod:`.progress`), and the attempt's result (the chunk
operator's XCom)."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.budget import SharedBudget
from airflow_retention.core.running.pacing import Pacer, Throttler
from airflow_retention.core.sql.target import TargetInfo


@dataclass
class BatchReport:
    lo: int
    hi: int
    tenant: str | None
    size: int
    deleted: int
    archived: int
    matched: int
    ms: float
    backoffs: int = 0
    backoff_seconds: float = 0.0


@dataclass
class ChunkResult:
    """What one attempt at a chunk did; :meth:`summary` is the operator's XCom."""

    run_key: str
    chunk_key: str
    already_complete: bool = False
    rows_deleted: int = 0
    rows_archived: int = 0
    rows_matched: int = 0
    batches: int = 0
    seconds: float = 0.0
    backoffs: int = 0
    backoff_seconds: float = 0.0
    batches_cut: int = 0
    duty_seconds: float = 0.0
    last_batch_size: int | None = None
    resumed_from: int | None = None
    outcome: str | None = None
    # Seconds paused by the database budget, by reason (docs/concepts.md, "The database budget").
    paused: dict[str, float] = field(default_factory=dict)
    batch_log: list[BatchReport] = field(default_factory=list)
    tenant_rows: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("batch_log")
        data.pop("tenant_rows")
        if self.tenant_rows:  # one-pass tenant chunks: the tenants this attempt deleted most of
            data["tenants"] = len(self.tenant_rows)
            data["top_tenants"] = sorted(self.tenant_rows.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        data["seconds"] = round(self.seconds, 3)
        data["backoff_seconds"] = round(self.backoff_seconds, 3)
        data["duty_seconds"] = round(self.duty_seconds, 3)
        data["longest_batch_ms"] = round(max((b.ms for b in self.batch_log), default=0.0), 1)
        return data


def default_host(hostname: str | None = None) -> str:
    """``host:pid`` of this process, as the ledger records who ran a batch."""
    return f"{hostname or socket.gethostname()}:{os.getpid()}"


@dataclass
class ChunkRun:
    """One attempt at a chunk: what its batches need and what they have done so far."""

    conn: Any
    policy: RetentionPolicy
    target: TargetInfo
    ledger: Ledger
    key: str
    chunk: ChunkSpec
    attempt: Attempt
    cutoffs: TenantCutoffs
    pacer: Pacer
    throttler: Throttler
    budget: SharedBudget
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    on_batch: Callable[[BatchReport], None] | None = None
    result: ChunkResult = field(init=False)
    # The last batch's throttle backoffs (count, seconds), taken as its receipt is recorded.
    backoffs: tuple[int, float] = (0, 0.0)

    # Every batch statement's parameters that do not change within the attempt: the frozen cutoffs, and
    # no tenant chosen or skipped.
    params: dict[str, Any] = field(init=False)

    def paused_for_batch(self) -> dict[str, float]:
        """The budget's pauses since the last batch recorded, by reason, into the result and the ledger."""
        paused = self.budget.take()
        for reason, seconds in paused.items():
            self.result.paused[reason] = round(self.result.paused.get(reason, 0.0) + seconds, 3)
        return paused

    def __post_init__(self) -> None:
        self.result = ChunkResult(run_key=self.key, chunk_key=self.chunk.key)
        self.params = {**self.cutoffs.params(), "only": None, "skip": []}

    @property
    def sync(self) -> str | None:
        """The batches' synchronous_commit (SET LOCAL), None for the server's own."""
        return None if self.policy.synchronous_commit == "server" else self.policy.synchronous_commit
