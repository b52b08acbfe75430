"""Where a chunk's walk stands and where each batch's receipt goes, in the batch's own transaction.

The chunk engine's loop is the same for a chunk's first pass and for the retry of its dead letters; what
differs is kept here. :class:`LedgerProgress` reads the position from the chunk's ledger row (a killed
attempt resumes after its last commit) and records every batch there, completing the chunk with its
last. :class:`RedoProgress` walks the tenants a complete chunk left as dead letters once more, keeps its
position in memory (the chunk is complete: its row's position is final), and adds what it deletes to
the chunk's counts.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.records import ChunkSpec, DeadLetter
from airflow_retention.core.planning.walkers.base import Batch, Position, Walker
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.batches import Counts, counts_tenants
from airflow_retention.core.running.context import ChunkRun
from airflow_retention.core.running.isolation import TenantFailure
from airflow_retention.core.running.partition_checks import gone_reason, partition_state
from airflow_retention.core.sql.partitions import lock_statement
from airflow_retention.core.sql.predicate import tenant_cutoff, tenant_value, tenant_values

log = logging.getLogger(__name__)


class Progress(ABC):
    def __init__(self, run: ChunkRun) -> None:
        self.run = run

    @abstractmethod
    def lock(self, cur: Any) -> Position | None:
        """Lock the chunk's ledger row (attempts of one chunk queue here) and return where the walk
        stands, or None when there is nothing left to do."""

    def params(self, cur: Any) -> dict[str, Any]:
        """Parameters of the batch statement that depend on the run's progress so far."""
        run = self.run
        if run.policy.max_rows_per_tenant:  # tenants at their cap are left out of later batches
            return {"xt": at_cap(cur, run)}
        return {}

    def begin(self, cur: Any, at: Position) -> bool:
        """With the chunk's row locked, before the batch: whether the batch goes ahead. A leaf partition
        detached or dropped since planning stops the walk: its rows are no longer the table's to purge;
        else the leaf stays locked until the batch commits."""
        run = self.run
        if (gone := leaf_gone(cur, run.policy, run.chunk)) is not None:
            self.leaf_went(cur, gone)
            return False
        return True

    @abstractmethod
    def leaf_went(self, cur: Any, why: str) -> None:
        """The walk's leaf partition is gone (``why``): settle what the walk leaves."""

    def committed(self) -> None:  # noqa: B027 - only a walk kept in memory has something to apply
        """The batch recorded by :meth:`record` has committed."""

    @abstractmethod
    def record(self, cur: Any, at: Position, after: Position, batch: Batch, counts: Counts, size: int) -> bool:
        """Record the batch in the ledger, in its transaction; return whether the walk is over."""

    def count_tenants(self, cur: Any, counts: Counts) -> None:
        """A batch counted by tenant: its rows per tenant into the ledger and the attempt's tally."""
        run = self.run
        if counts.per_tenant is None:
            return
        run.ledger.add_tenant_counts(cur, run.key, run.chunk.key, counts.per_tenant)
        for tenant, n, _, m in counts.per_tenant:
            run.result.tenant_rows[tenant] = run.result.tenant_rows.get(tenant, 0) + int(n) + int(m)


class LedgerProgress(Progress):
    """A chunk's walk as its ledger row keeps it."""

    def __init__(self, run: ChunkRun, walker: Walker) -> None:
        super().__init__(run)
        self.walker = walker
        self.earlier_deleted = 0

    def lock(self, cur: Any) -> Position | None:
        run = self.run
        row = run.ledger.lock_chunk(cur, run.key, run.chunk.key)
        if row is None:
            raise PermanentError(f"chunk {run.chunk.key} of run {run.key} has no ledger row")
        state, next_key, _, _, _, self.earlier_deleted, pos = row[:7]
        if state == "complete":
            run.result.already_complete = run.result.batches == 0
            return None
        return Position(next_key, pos)

    def begin(self, cur: Any, at: Position) -> bool:
        run = self.run
        if not super().begin(cur, at):
            return False
        if run.result.batches == 0:
            resumed = at.key != run.chunk.lo or at.tenant
            run.result.resumed_from = at.key if resumed else None
        return True

    def params(self, cur: Any) -> dict[str, Any]:
        run = self.run
        params = super().params(cur)
        if counts_tenants(run.policy, run.chunk):
            # The chunk's dead letters are left out of its later batches.
            params["skip"] = [d["tenant"] for d in run.ledger.open_dead_letters(cur, run.key, run.chunk.key)]
        return params

    def record(self, cur: Any, at: Position, after: Position, batch: Batch, counts: Counts, size: int) -> bool:
        run = self.run
        self.count_tenants(cur, counts)
        record_dead_letters(cur, run, counts.failures)
        exhausted = self.walker.done(after)
        outcome = None
        if exhausted:
            total = self.earlier_deleted + counts.deleted
            outcome = "dry_run" if run.policy.dry_run else ("deleted" if total else "nothing_to_delete")
        run.backoffs = run.throttler.take()
        if exhausted and run.sync == "off":
            # The chunk's receipt is durable once reported, and with it every batch before it.
            dbapi.durable_commit(cur)
        run.ledger.record_batch(
            cur,
            run.key,
            run.chunk.key,
            next_key=after.key,
            tenant_pos=after.tenant,
            batch_size=size,
            backoffs=run.backoffs[0],
            backoff_seconds=run.backoffs[1],
            deleted=counts.deleted,
            archived=counts.archived,
            matched=counts.matched,
            complete=exhausted,
            outcome=outcome,
            attempt=run.attempt,
            first_batch_of_attempt=run.result.batches == 0,
            paused=run.paused_for_batch(),
        )
        return exhausted

    def leaf_went(self, cur: Any, why: str) -> None:
        """Complete the chunk of a leaf detached or dropped since planning."""
        run = self.run
        log.warning(
            "chunk %s: partition %s %s since planning: chunk complete, nothing more to delete there",
            run.chunk.key,
            run.chunk.partition,
            why,
        )
        if run.sync == "off":
            dbapi.durable_commit(cur)
        outcome = "deleted" if self.earlier_deleted else "partition_gone"
        first = run.result.batches == 0
        run.ledger.complete_chunk(cur, run.key, run.chunk, run.attempt, outcome=outcome, first_batch_of_attempt=first)
        run.result.batches += 1


class RedoProgress(Progress):
    """The dead-lettered tenants of a complete chunk, purged again: a tenant that fails again is left out
    of the later batches and stays a dead letter; the others' are resolved (:meth:`settle`)."""

    def __init__(self, run: ChunkRun, walker: Walker, failed: Sequence[str]) -> None:
        super().__init__(run)
        self.walker, self.failed = walker, list(failed)
        self.at = Position(run.chunk.lo)
        self.still: dict[str, TenantFailure] = {}
        # What the batch being recorded changes, applied once it commits (a failed commit takes it again).
        self.pending: tuple[Position, list[TenantFailure]] | None = None

    def lock(self, cur: Any) -> Position | None:
        run = self.run
        run.ledger.lock_chunk(cur, run.key, run.chunk.key)  # attempts of one chunk queue here
        if self.walker.done(self.at) or not self.going():
            return None
        return self.at

    def take_back_counted(self) -> None:
        """A dry run, before its walk: the walk starts at the chunk's start and, a dry run having deleted
        nothing, meets again the rows the earlier walks counted before each tenant failed. Those counts
        come off the ledger first, so that each row is counted once, by the last walk."""
        run = self.run
        with dbapi.transaction(run.conn) as cur:
            taken = run.ledger.take_back_matched(
                cur,
                run.key,
                run.chunk.key,
                self.failed,
                same_tenant=tenant_value(run.target, "tenant"),
                listed=tenant_values(run.target, "%(t)s"),
            )
        if taken:
            log.info(
                "chunk %s: dry run: the %d row(s) of tenant(s) %s counted before they failed are counted again"
                " by this walk",
                run.chunk.key,
                taken,
                ", ".join(self.failed[:10]),
            )

    def going(self) -> list[str]:
        return [t for t in self.failed if t not in self.still]

    def params(self, cur: Any) -> dict[str, Any]:
        return {**super().params(cur), "only": self.going()}

    def record(self, cur: Any, at: Position, after: Position, batch: Batch, counts: Counts, size: int) -> bool:
        run = self.run
        self.count_tenants(cur, counts)
        run.ledger.add_redone_rows(
            cur, run.key, run.chunk.key, deleted=counts.deleted, archived=counts.archived, matched=counts.matched
        )
        run.backoffs = run.throttler.take()
        self.pending = (after, counts.failures)
        failed_again = {f.tenant for f in counts.failures}
        return self.walker.done(after) or not [t for t in self.going() if t not in failed_again]

    def committed(self) -> None:
        assert self.pending is not None
        self.at, failures = self.pending
        self.still.update((f.tenant, f) for f in failures)
        self.pending = None

    def leaf_went(self, cur: Any, why: str) -> None:
        log.warning(
            "chunk %s: partition %s %s since planning: its rows are no longer the table's to purge; the dead"
            " letters of tenant(s) %s there are resolved",
            self.run.chunk.key,
            self.run.chunk.partition,
            why,
            ", ".join(self.going()[:10]),
        )

    def settle(self) -> list[dict[str, Any]]:
        """Record the tenants that failed again, resolve the others; the chunk's open dead letters. A
        tenant at its ``max_rows_per_tenant`` was left out of the walk like any capped tenant, its rows
        deferred to the next run: its dead letter is resolved too, and said so."""
        run = self.run
        with dbapi.transaction(run.conn) as cur:
            record_dead_letters(cur, run, list(self.still.values()))
            if run.policy.max_rows_per_tenant:
                capped = set(at_cap(cur, run))
                if deferred := [t for t in self.going() if t in capped]:
                    log.info(
                        "chunk %s: dead-lettered tenant(s) %s reached max_rows_per_tenant %d in this run: their"
                        " rows are deferred to the next run, and their dead letters resolved",
                        run.chunk.key,
                        ", ".join(deferred[:10]),
                        run.policy.max_rows_per_tenant,
                    )
            run.ledger.resolve_dead_letters(cur, run.key, run.chunk.key, self.going())
            return run.ledger.open_dead_letters(cur, run.key, run.chunk.key)


def at_cap(cur: Any, run: ChunkRun) -> list[str]:
    """The run's tenants at their ``max_rows_per_tenant``, their spellings counted together."""
    assert run.policy.max_rows_per_tenant is not None
    return run.ledger.tenants_at_cap(
        cur, run.key, run.policy.max_rows_per_tenant, same_tenant=tenant_value(run.target, "tenant")
    )


def record_dead_letters(cur: Any, run: ChunkRun, failures: list[TenantFailure]) -> None:
    for failure in failures:
        log.warning(
            "chunk %s: tenant %s failed and is left out of the chunk (dead letter): %s; the other tenants go on",
            run.chunk.key,
            failure.tenant,
            failure.failure_class,
        )
        # The tenant's own cutoff as the statements apply it: an override spelled otherwise still counts.
        cur.execute(
            f"SELECT {tenant_cutoff(run.target, '%(tenant)s')}", {**run.cutoffs.params(), "tenant": failure.tenant}
        )
        (cutoff,) = cur.fetchone()
        letter = DeadLetter(failure.tenant, cutoff, failure.failure_class, failure.sqlstate, failure.message)
        run.ledger.record_dead_letter(cur, run.key, run.chunk, letter)


def _gone(cur: Any, policy: RetentionPolicy, chunk: ChunkSpec) -> str | None:
    assert chunk.partition is not None and chunk.partition_oid is not None
    return gone_reason(partition_state(cur, policy, chunk.partition_oid), TableName.parse(chunk.partition))


def leaf_vanished(conn: Any, policy: RetentionPolicy, chunk: ChunkSpec) -> bool:
    """Whether the chunk's leaf is gone now (no lock taken): after a batch failed on it."""
    with dbapi.transaction(conn) as cur:
        return _gone(cur, policy, chunk) is not None


def leaf_gone(cur: Any, policy: RetentionPolicy, chunk: ChunkSpec) -> str | None:
    """Why the chunk's leaf partition can no longer be purged (dropped, detached, renamed), or None after
    locking it for the batch (None too for a chunk of no leaf): with ROW EXCLUSIVE (a dry run: ACCESS
    SHARE) held, a concurrent DETACH cannot finish mid-batch."""
    if chunk.partition is None:
        return None
    if (reason := _gone(cur, policy, chunk)) is not None:
        return reason
    # A dry run only reads: ACCESS SHARE also keeps a DETACH from finishing, and needs no write privilege.
    cur.execute(lock_statement(TableName.parse(chunk.partition), "ACCESS SHARE" if policy.dry_run else "ROW EXCLUSIVE"))
    return _gone(cur, policy, chunk)
