"""Partition chunks: a wholly expired partition detached (``expired_partitions: detach``) or dropped
(``drop``) instead of deleted row by row.

Two ways, chosen when the chunk runs:

- **concurrent** (no ``condition``, no DEFAULT partition beside it): record in the ledger that the
  detach begins (committed), ``DETACH PARTITION … CONCURRENTLY`` in autocommit (SHARE UPDATE EXCLUSIVE
  on the parent: queries on the table go on), then one transaction that counts the detached table's
  rows, drops it (``drop``) or moves it to ``detached_schema``, and completes the ledger row;
- **atomic** (a ``condition``, or a DEFAULT partition, with which PostgreSQL refuses CONCURRENTLY): one
  transaction that locks the partition against writes (SHARE), proves with the condition that every
  row is eligible (else the chunk ends ``kept`` and the rows wait for block chunks of the next run),
  counts, plain ``DETACH`` (ACCESS EXCLUSIVE on the parent until the commit, milliseconds later),
  drop or move, ledger; a crash anywhere rolls all of it back.

Every crash window is a retry away from done, exactly once: killed before the detach → the retry
detaches; killed inside ``DETACH … CONCURRENTLY`` → the partition is left "pending detach" and the
retry runs ``DETACH … FINALIZE``; killed after the detach → the retry finds the partition detached,
sees in the ledger that the detach was its own, counts and completes. A partition detached or dropped
by someone else completes the chunk with 0 rows (``partition_gone``). Lock waits stop at
``lock_timeout`` and the chunk fails retryable; nothing is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_retention.core import dbapi
from airflow_retention.core.catalog import TargetInfo, check_detached_schema
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.identifiers import TableName
from airflow_retention.core.ledger import Attempt, ChunkSpec, Ledger
from airflow_retention.core.partitions import needs_row_check
from airflow_retention.core.policy import RetentionPolicy
from airflow_retention.core.sql import (
    PARTITION_STATE,
    count_statement,
    detach_statement,
    drop_statement,
    ineligible_exists_statement,
    lock_statement,
    set_schema_statement,
)
from airflow_retention.core.tenants import TenantCutoffs

log = logging.getLogger(__name__)

# How soon a backend notices that its client (a killed worker) is gone while it waits inside a detach.
CLIENT_CHECK_INTERVAL = "1s"


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


@dataclass
class PartitionOutcome:
    rows: int
    outcome: str  # 'dropped', 'detached', 'kept', 'partition_gone', 'dry_run'
    already_complete: bool = False
    how: str = ""


def run_partition_chunk(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    *,
    cutoffs: TenantCutoffs,
    on_step: Callable[[str], None] | None = None,
) -> PartitionOutcome:
    """Detach or drop the chunk's partition once, whatever happened to earlier attempts.

    :param on_step: called with ``"before_detach"`` and ``"after_detach"`` (the fault drills kill the
        process there).
    """
    if chunk.partition is None or chunk.partition_oid is None or chunk.action not in ("detach", "drop"):
        raise ValueError(f"chunk {chunk.key} is not a partition chunk")
    planned = TableName.parse(chunk.partition)
    step = on_step or (lambda _: None)
    if not policy.dry_run:
        check_detached_schema(conn, policy)  # before anything is detached
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        row = ledger.lock_chunk(cur, run_key, chunk.key)
        if row is None:
            raise PermanentError(f"chunk {chunk.key} of run {run_key} has no ledger row")
        if row[0] == "complete":
            return PartitionOutcome(0, "", already_complete=True)
        started = row[10] is not None
        state = partition_state(cur, policy, chunk.partition_oid)
        ours_detached = state is not None and state.table.name == planned.name and not state.attached and started
        if state is None or state.table.name != planned.name or (not state.attached and not started):
            why = "was dropped" if state is None else ("was renamed" if state.table.name != planned.name else "")
            why = why or "was detached by someone else"
            log.warning(
                "chunk %s: partition %s %s before this chunk ran: nothing to %s, chunk complete with 0 rows",
                chunk.key,
                planned,
                why,
                chunk.action,
            )
            _complete(cur, ledger, run_key, chunk, attempt, 0, "partition_gone")
            return PartitionOutcome(0, "partition_gone", how=why)
        if state.attached and not state.in_table:
            log.warning("chunk %s: partition %s now belongs to another table: left alone", chunk.key, planned)
            _complete(cur, ledger, run_key, chunk, attempt, 0, "partition_gone")
            return PartitionOutcome(0, "partition_gone", how="moved to another table")
        if policy.dry_run:
            cur.execute(count_statement(state.table))
            (rows,) = cur.fetchone()
            ledger.complete_chunk(cur, run_key, chunk, attempt, outcome="dry_run", matched=int(rows))
            return PartitionOutcome(int(rows), "dry_run", how="counted (dry run)")
        if state.pending_detach and not ours_detached and needs_row_check(policy) and not started:
            log.warning(
                "chunk %s: partition %s is pending detach by someone else's interrupted DETACH; its rows cannot be"
                " checked against the condition or the tenant rule any more, so it is left as it is (FINALIZE"
                " it by hand, docs/runbook.md)",
                chunk.key,
                planned,
            )
            _complete(cur, ledger, run_key, chunk, attempt, 0, "kept")
            return PartitionOutcome(0, "kept", how="pending detach by someone else")
        atomic = (
            not state.pending_detach and not ours_detached and (needs_row_check(policy) or state.parent_has_default)
        )
        if atomic:
            return _atomic(cur, policy, target, run_key, chunk, attempt, ledger, state, cutoffs=cutoffs, step=step)
        if not ours_detached and not state.pending_detach:
            ledger.start_action(cur, run_key, chunk.key, attempt)
    # Committed: a retry that finds the partition detached knows it was this chunk's doing.
    if state.attached:
        assert state.parent is not None
        mode = "FINALIZE" if state.pending_detach else "CONCURRENTLY"
        step("before_detach")
        log.info("chunk %s: ALTER TABLE %s DETACH PARTITION %s %s", chunk.key, state.parent, state.table, mode)
        dbapi.outside_transaction(
            conn,
            detach_statement(state.parent, state.table, mode),
            {
                "lock_timeout": str(policy.lock_timeout_ms),
                "statement_timeout": str(policy.statement_timeout_ms),
                "client_connection_check_interval": CLIENT_CHECK_INTERVAL,
            },
        )
        step("after_detach")
    return _finish(conn, policy, run_key, chunk, attempt, ledger, planned)


def _finish(
    conn: Any,
    policy: RetentionPolicy,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    planned: TableName,
) -> PartitionOutcome:
    """After the detach: count the detached table, drop or move it, complete the ledger, in one commit."""
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        row = ledger.lock_chunk(cur, run_key, chunk.key)
        if row is None or row[0] == "complete":
            return PartitionOutcome(0, "", already_complete=True)
        assert chunk.partition_oid is not None
        state = partition_state(cur, policy, chunk.partition_oid)
        if state is None:
            # Someone dropped the table this chunk had detached: nothing is left to count or drop.
            log.warning("chunk %s: partition %s was dropped by someone else after its detach", chunk.key, planned)
            _complete(cur, ledger, run_key, chunk, attempt, 0, "partition_gone")
            return PartitionOutcome(0, "partition_gone", how="dropped by someone else after the detach")
        if state.attached:
            # Re-attached since the detach: the retry sees it attached, its detach begun, and detaches again.
            raise RetryableError(f"chunk {chunk.key}: partition {planned} was attached again during its detach")
        cur.execute(lock_statement(state.table, "SHARE"))
        cur.execute(count_statement(state.table))
        (rows,) = cur.fetchone()
        outcome = _remove(cur, policy, chunk, state.table)
        _complete(cur, ledger, run_key, chunk, attempt, int(rows), outcome)
    log.info("chunk %s: partition %s %s with %d row(s)", chunk.key, planned, outcome, rows)
    return PartitionOutcome(int(rows), outcome, how="detached concurrently")


def _atomic(
    cur: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    state: PartitionState,
    *,
    cutoffs: TenantCutoffs,
    step: Callable[[str], None],
) -> PartitionOutcome:
    """Check, count, plain DETACH, drop or move, and the ledger, all in the caller's transaction."""
    assert state.parent is not None
    cur.execute(lock_statement(state.table, "SHARE"))
    if needs_row_check(policy):
        cur.execute(ineligible_exists_statement(policy, target, state.table), cutoffs.params())
        if cur.fetchone()[0]:
            log.warning(
                "chunk %s: partition %s holds a row the condition or the tenant rule keeps: not %s;"
                " its eligible rows are deleted by the next run's block chunks",
                chunk.key,
                state.table,
                "dropped" if chunk.action == "drop" else "detached",
            )
            _complete(cur, ledger, run_key, chunk, attempt, 0, "kept")
            return PartitionOutcome(0, "kept", how="a row is kept by the condition or has no tenant")
    cur.execute(count_statement(state.table))
    (rows,) = cur.fetchone()
    step("before_detach")
    why = "condition checked under lock" if policy.condition else "a DEFAULT partition forbids CONCURRENTLY"
    log.info("chunk %s: ALTER TABLE %s DETACH PARTITION %s (%s)", chunk.key, state.parent, state.table, why)
    cur.execute(detach_statement(state.parent, state.table, ""))
    outcome = _remove(cur, policy, chunk, state.table)
    step("after_detach")
    _complete(cur, ledger, run_key, chunk, attempt, int(rows), outcome)
    log.info("chunk %s: partition %s %s with %d row(s)", chunk.key, state.table, outcome, rows)
    return PartitionOutcome(int(rows), outcome, how=f"plain DETACH ({why})")


def _remove(cur: Any, policy: RetentionPolicy, chunk: ChunkSpec, table: TableName) -> str:
    if chunk.action == "drop":
        cur.execute(drop_statement(table))
        return "dropped"
    if policy.detached_schema is not None and table.schema != policy.detached_schema:
        cur.execute(set_schema_statement(table, policy.detached_schema))
    return "detached"


def _complete(
    cur: Any, ledger: Ledger, run_key: str, chunk: ChunkSpec, attempt: Attempt, rows: int, outcome: str
) -> None:
    ledger.complete_chunk(cur, run_key, chunk, attempt, outcome=outcome, deleted=rows)
