"""What every walker is: a way of cutting a table that plans its chunks and, inside a chunk, yields the
bounds of one batch after another (the model is GitLab's batched migrations, one batching strategy per
class with one ``next_batch``).

A walker's plan side is a function of its module (``plan_blocks``, ``plan_keys``, ``plan_partitioned``)
that the planner calls by the policy's shape; its batch side is a :class:`Walker` that the chunk engine
(:mod:`airflow_retention.core.running.engine`) drives: it asks for the next batch at a
:class:`Position`, runs the batch statement with the batch's parameters, and records where the walk
goes on (:meth:`Walker.after`) in the same transaction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from airflow_retention.core.ledger.records import ChunkSpec


@dataclass(frozen=True)
class Position:
    """Where a chunk's walk stands: the next block or key of its range, and the tenant it is on (an index
    into the walker's tenants; 0 when it has none). The ledger keeps it (``next_key``, ``tenant_pos``)."""

    key: int
    tenant: int = 0


@dataclass(frozen=True)
class Batch:
    """One batch's bounds.

    :param lo: its first block or key.
    :param hi: where the next batch starts (the first block or key after this one).
    :param full: more blocks or keys follow in the range (of the same tenant).
    :param params: the batch statement's parameters for these bounds.
    :param tenant: the tenant the batch deletes, when the walker goes tenant by tenant.
    """

    lo: int
    hi: int
    full: bool
    params: dict[str, Any] = field(default_factory=dict)
    tenant: str | None = None


class Walker(ABC):
    """The batches of one chunk. ``tenants``: the tenants walked one after another (a chunk's own list,
    or the dead-lettered ones a retry takes again); None when the walk takes every tenant at once."""

    #: How a log line names a batch's range: "blocks" or "ids".
    unit: ClassVar[str]

    def __init__(self, chunk: ChunkSpec, tenants: Sequence[str] | None = None) -> None:
        self.chunk = chunk
        self.tenants = tuple(tenants) if tenants is not None else None

    def open(self, conn: Any) -> None:  # noqa: B027 - most walkers need nothing before their first batch
        """Read what the walk needs before its first batch (a table's size)."""

    @abstractmethod
    def next_batch(self, cur: Any, at: Position, size: int) -> Batch:
        """The bounds of the batch of about ``size`` rows that starts at ``at``."""

    def after(self, at: Position, batch: Batch, *, tenant_done: bool = False) -> Position:
        """Where the walk goes on after ``batch``: in the same tenant while its range has more, else at the
        start of the next tenant's, else at the chunk's end (:meth:`done`). ``tenant_done``: the tenant
        is left early (its rows failed)."""
        if batch.full and not tenant_done:
            return Position(batch.hi, at.tenant)
        if self.tenants is not None and at.tenant + 1 < len(self.tenants):
            return Position(self.chunk.lo, at.tenant + 1)
        return Position(self.chunk.hi, at.tenant)

    def done(self, at: Position) -> bool:
        return at.key >= self.chunk.hi
