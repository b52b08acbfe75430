"""The batch statements as the chunk engine runs them, one class per kind of batch, each returning what
it did as :class:`Counts`: a range batch (a plain ``DELETE``, a ``DELETE`` that archives, or a dry run's
count), the same for one tenant of a key chunk with that tenant's failure isolated, and the one-pass
batch that deletes every tenant's rows of some blocks and counts them per tenant. Their text comes from
:mod:`airflow_retention.core.sql.batches`, built on the one eligibility predicate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.isolation import TenantFailure, run_for_tenant, run_isolated
from airflow_retention.core.sql.batches import (
    TenantBatch,
    batch_counts_tenants,
    batch_statement,
    batch_statement_returns_counts,
    tenant_batch,
    tenants_in_batch_statement,
)
from airflow_retention.core.sql.target import TargetInfo


@dataclass
class Counts:
    """What a batch did. ``per_tenant``: one row per tenant (tenant, deleted, archived, matched) when the
    batch counts by tenant (recorded in the ledger's tenant counts), else None; ``failures``: the
    tenants whose rows failed and were left (dead letters)."""

    deleted: int = 0
    archived: int = 0
    matched: int = 0
    per_tenant: list[tuple[Any, ...]] | None = None
    failures: list[TenantFailure] = field(default_factory=list)

    @classmethod
    def of_tenants(cls, per_tenant: list[tuple[Any, ...]], failures: list[TenantFailure]) -> Counts:
        deleted, archived, matched = (sum(int(r[i]) for r in per_tenant) for i in (1, 2, 3))
        return cls(deleted, archived, matched, per_tenant, failures)


class BatchStatement(ABC):
    #: Whether the batch must run under one REPEATABLE READ snapshot (a count and a delete that must agree).
    snapshot: bool = False

    @abstractmethod
    def run(self, cur: Any, params: dict[str, Any]) -> Counts:
        """Run the batch with the walker's bounds and the run's parameters in ``params``."""


class RangeBatch(BatchStatement):
    """A batch over the walker's range: a plain ``DELETE`` (its row count is the count), or a statement
    that returns one row of counts (an archiving ``DELETE``, a dry run's count)."""

    def __init__(self, text: str, returns_counts: bool) -> None:
        self.text, self.returns_counts = text, returns_counts

    def run(self, cur: Any, params: dict[str, Any]) -> Counts:
        cur.execute(self.text, params)
        if not self.returns_counts:
            return Counts(cur.rowcount)
        deleted, archived, matched = (int(n) for n in cur.fetchone())
        return Counts(deleted, archived, matched)


class TenantRangeBatch(RangeBatch):
    """One tenant's batch of a key chunk, under a savepoint: a tenant whose rows fail is left (a dead
    letter) and the chunk goes on with its next tenant."""

    def run(self, cur: Any, params: dict[str, Any]) -> Counts:
        tenant = params["tenant"]
        counts, failure = run_for_tenant(cur, self.text, params, tenant, returns_counts=self.returns_counts)
        per_tenant = [(tenant, *counts)] if any(counts) else []
        return Counts.of_tenants(per_tenant, [failure] if failure is not None else [])


class TenantPassBatch(BatchStatement):
    """The one-pass batch: every tenant's eligible rows of the blocks, counted per tenant (``%(only)s``
    restricts it to some tenants, ``%(skip)s`` leaves out the dead letters); a tenant whose rows fail is
    left and the others go through (:func:`~airflow_retention.core.running.isolation.run_isolated`)."""

    def __init__(self, passes: TenantBatch, tenants_statement: str) -> None:
        self.passes, self.tenants_statement = passes, tenants_statement
        self.snapshot = passes.needs_snapshot

    def run(self, cur: Any, params: dict[str, Any]) -> Counts:
        per_tenant, failures = run_isolated(cur, self.passes, params, self.tenants_statement, only=params.get("only"))
        return Counts.of_tenants(per_tenant, failures)


def counts_tenants(policy: RetentionPolicy, chunk: ChunkSpec) -> bool:
    """Whether the chunk's batches are one-pass batches counted per tenant (:class:`TenantPassBatch`)."""
    return batch_counts_tenants(policy, listed_tenants=chunk.tenants is not None)


def statement_for(policy: RetentionPolicy, target: TargetInfo, chunk: ChunkSpec) -> BatchStatement:
    """The batch statement of a chunk, by the policy's kind of batch (block batches of a leaf partition
    run on the leaf: a TID range only means something on one physical table). Every batch of a policy
    with a tenant column counts its tenants: one pass over the range, or one listed tenant at a time."""
    leaf = TableName.parse(chunk.partition) if chunk.partition is not None else None
    if counts_tenants(policy, chunk):
        return TenantPassBatch(tenant_batch(policy, target, leaf), tenants_in_batch_statement(policy, target, leaf))
    text = batch_statement(policy, target, tenant_filter=chunk.tenants is not None, relation=leaf)
    returns_counts = batch_statement_returns_counts(policy)
    return TenantRangeBatch(text, returns_counts) if chunk.tenants is not None else RangeBatch(text, returns_counts)


def check_archived(policy: RetentionPolicy, chunk: ChunkSpec, counts: Counts) -> None:
    """Every row a batch deletes must reach the archive table in the same statement. A trigger or a rule
    on the archive can swallow rows (a BEFORE INSERT trigger returning NULL): the batch is then refused,
    and its transaction, deletions included, rolled back."""
    if policy.archive_table is None or policy.dry_run or counts.archived == counts.deleted:
        return
    raise PermanentError(
        f"chunk {chunk.key}: a batch deleted {counts.deleted} row(s) but archive_table {policy.archive_table}"
        f" received {counts.archived}: a trigger or rule on {policy.archive_table} drops rows (a BEFORE INSERT"
        " trigger returning NULL, a DO INSTEAD rule). The batch was rolled back: nothing of it was deleted. Fix"
        " the archive table, then clear the chunk task"
    )
