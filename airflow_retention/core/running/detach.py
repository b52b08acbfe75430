"""Partition chunks: a wholly expired partition detached (``expired_partitions: detach``) or dropped
(``drop``) instead of deleted row by row.

First, whenever it runs, the chunk checks that its action is still wanted, never on the plan's word
alone: it does no more than both its plan and the policy as it is now allow
(:func:`~airflow_retention.core.running.partition_checks.wanted_action`), and the partition's bound,
read from the catalog in that transaction, must prove every row expired at the run's frozen cutoff
(:func:`~airflow_retention.core.planning.partitions.expired_by_bound`); otherwise the partition is
``kept``. Then one of two ways:

- **concurrent** (no ``condition``, no tenant column, no DEFAULT partition beside it):
  ``DETACH PARTITION … CONCURRENTLY`` in autocommit (SHARE UPDATE EXCLUSIVE on the parent: queries on
  the table go on);
- **atomic** (a ``condition`` or a tenant column, whose rows must be proved eligible under lock, or a
  DEFAULT partition, with which PostgreSQL refuses CONCURRENTLY): the rows checked once without any lock
  that writers wait for, then one short transaction that locks the parent first and the partition
  second (the order of writers through the parent, so that they never deadlock) in SHARE mode (writers
  wait, readers go on), re-reads the bound, checks the rows again, and takes ACCESS EXCLUSIVE on the
  parent only for the plain ``DETACH`` itself.

The chunk records that the detach is its own (``action_started_at``) only once it knows: in the plain
detach's own commit, after ``CONCURRENTLY`` returned, or after a failed one left the partition pending
detach. Then one transaction counts the detached table (per tenant too), checks every row of it against
the policy in the same scan, drops it (``drop``) or moves it to ``detached_schema``, and completes the
ledger row; a table holding a row the policy keeps is left detached, never dropped.

Every crash window is a retry away from done, exactly once: killed before the detach → the retry
detaches; killed inside ``DETACH … CONCURRENTLY`` → the partition is left "pending detach" and the
retry runs ``DETACH … FINALIZE``; killed after the claimed detach → the retry finds the partition
detached, sees in the ledger that the detach was its own, counts and completes. A partition detached
without that record, or dropped, by someone else completes the chunk with 0 rows (``partition_gone``)
and is never dropped. Lock waits stop at ``lock_timeout`` and the chunk fails retryable; nothing is lost.

What the chunk reads before it acts (the partition's state, the action still wanted, the census of its
rows) lives in :mod:`~airflow_retention.core.running.partition_checks`; this module owns the acts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi, partman
from airflow_retention.core.db.catalog import check_detached_schema
from airflow_retention.core.db.move import move_to_schema
from airflow_retention.core.errors import PermanentError, RetentionError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.planning.partitions import expired_by_bound, needs_row_check
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.partition_checks import Census, census, partition_state, wanted_action
from airflow_retention.core.sql.partitions import (
    detach_statement,
    drop_statement,
    ineligible_exists_statement,
    lock_statement,
)
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)

# How soon a backend notices that its client (a killed worker) is gone while it waits inside a detach.
CLIENT_CHECK_INTERVAL = "1s"


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
    """Detach or drop the chunk's partition once, whatever happened to earlier attempts, and only if the
    policy as it is now and the partition's bound (read from the catalog now, against the run's frozen
    cutoff) still call for it; otherwise the partition is ``kept``.

    :param on_step: called with ``"before_detach"`` and ``"after_detach"`` (the fault drills kill the
        process there).
    """
    if chunk.partition is None or chunk.partition_oid is None or chunk.action not in ("detach", "drop"):
        raise ValueError(f"chunk {chunk.key} is not a partition chunk")
    planned = TableName.parse(chunk.partition)
    step = on_step or (lambda _: None)
    action, changed = wanted_action(policy, chunk.action)
    if not policy.dry_run and action is not None:
        check_detached_schema(conn, policy)  # before anything is detached
        partman.check_chunk(conn, policy)
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        row = ledger.lock_chunk(cur, run_key, chunk.key)
        if row is None:
            raise PermanentError(f"chunk {chunk.key} of run {run_key} has no ledger row")
        if row[0] == "complete":
            return PartitionOutcome(0, "", already_complete=True)
        # Recorded only once a detach was seen to be this chunk's (it returned, or left the partition
        # pending): a partition found detached without it was detached by someone else.
        ours = row[10] is not None
        state = partition_state(cur, policy, chunk.partition_oid)
        if state is None or state.table.name != planned.name or (not state.attached and not ours):
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
        if action is None:
            return _keep(cur, ledger, run_key, chunk, attempt, planned, changed)
        if changed:
            log.warning("chunk %s: partition %s: %s", chunk.key, planned, changed)
        if state.attached and not expired_by_bound(cur, policy, target, cutoffs, chunk.partition_oid):
            # The plan's word is not enough: a lone chunk names any partition, and a partition may have
            # been re-attached with another bound since planning.
            return _keep(cur, ledger, run_key, chunk, attempt, planned, _NOT_EXPIRED)
        if policy.dry_run:
            with dbapi.read_only(cur):  # a dry run only counts; a write here would fail, not act
                counted = census(cur, policy, target, cutoffs, state.table)
            if counted.kept:
                return _keep(cur, ledger, run_key, chunk, attempt, planned, _kept_rows(counted))
            ledger.add_tenant_counts(cur, run_key, chunk.key, [(t, 0, 0, n) for t, n in counted.tenants])
            ledger.complete_chunk(cur, run_key, chunk, attempt, outcome="dry_run", matched=counted.rows)
            return PartitionOutcome(counted.rows, "dry_run", how="counted (dry run)")
        if state.pending_detach and not ours and needs_row_check(policy):
            return _keep(
                cur,
                ledger,
                run_key,
                chunk,
                attempt,
                planned,
                "it is pending detach by someone else's interrupted DETACH; its rows cannot be checked against the"
                " condition or the tenant rule any more, so it is left as it is (FINALIZE it by hand,"
                " docs/runbook.md)",
            )
        if not state.attached:
            mode = None  # this chunk's detach is done: what is left is the final transaction
        elif state.pending_detach:
            mode = "FINALIZE"
        elif needs_row_check(policy) or state.parent_has_default:
            mode = "atomic"
        else:
            mode = "CONCURRENTLY"
    if mode == "atomic":
        kept = _plain_detach(conn, policy, target, run_key, chunk, attempt, ledger, state.table, cutoffs, step)
        if kept is not None:
            return kept
        step("after_detach")
    elif mode is not None:
        assert state.parent is not None
        step("before_detach")
        log.info("chunk %s: ALTER TABLE %s DETACH PARTITION %s %s", chunk.key, state.parent, state.table, mode)
        try:
            dbapi.outside_transaction(
                conn,
                detach_statement(state.parent, state.table, mode),
                {
                    "lock_timeout": str(policy.lock_timeout_ms),
                    "statement_timeout": str(policy.statement_timeout_ms),
                    "client_connection_check_interval": CLIENT_CHECK_INTERVAL,
                },
            )
        except RetentionError:
            if mode == "CONCURRENTLY":  # a FINALIZE that fails leaves the partition as it found it
                _claim_if_pending(conn, policy, run_key, chunk, attempt, ledger, planned)
            raise
        _claim(conn, policy, run_key, chunk, attempt, ledger)
        step("after_detach")
    return _finish(conn, policy, target, run_key, chunk, attempt, ledger, planned, action, cutoffs)


_NOT_EXPIRED = (
    "its partition bound (read from the catalog now) does not prove every row older than the run's cutoff:"
    " it is not a RANGE partition on the timestamp column ending at or before the cutoff, nor below one"
)


def _kept_rows(counted: Census) -> str:
    return (
        f"{counted.kept} of its {counted.rows} row(s) are not eligible now (the condition keeps them, they have no"
        " tenant, or their tenant keeps rows longer); its eligible rows are deleted in batches by the next run"
    )


def _keep(
    cur: Any, ledger: Ledger, run_key: str, chunk: ChunkSpec, attempt: Attempt, planned: TableName, why: str
) -> PartitionOutcome:
    """Complete the chunk with outcome ``kept`` and 0 rows, saying why in the log."""
    log.warning(
        "chunk %s: partition %s is kept, not %s: %s",
        chunk.key,
        planned,
        "dropped" if chunk.action == "drop" else "detached",
        why,
    )
    _complete(cur, ledger, run_key, chunk, attempt, 0, "kept")
    return PartitionOutcome(0, "kept", how=why)


def _claim(
    conn: Any, policy: RetentionPolicy, run_key: str, chunk: ChunkSpec, attempt: Attempt, ledger: Ledger
) -> None:
    """Record that the partition's detach is this chunk's, now that it is known to be: a retry that finds
    it detached then finishes it; without this record it would leave it as someone else's."""
    with dbapi.transaction(conn) as cur:
        # Only another attempt of this chunk can hold its row, for one short transaction: wait for it
        # rather than leave a detach of ours unclaimed.
        wait = max(policy.lock_timeout_ms, policy.statement_timeout_ms)
        dbapi.set_local_timeouts(cur, wait, wait)
        ledger.start_action(cur, run_key, chunk.key, attempt)


def _claim_if_pending(
    conn: Any,
    policy: RetentionPolicy,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    planned: TableName,
) -> None:
    """After a failed ``DETACH … CONCURRENTLY``: a partition left pending is this chunk's detach half
    done (its retry finalizes it); one still attached was not detached at all, and nothing is claimed,
    so that a DBA who detaches it before the retry keeps it. Best effort: the error that brought us here
    is what the caller reports."""
    assert chunk.partition_oid is not None
    try:
        with dbapi.transaction(conn) as cur:
            dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
            state = partition_state(cur, policy, chunk.partition_oid)
            if state is not None and state.pending_detach and state.table.name == planned.name:
                ledger.start_action(cur, run_key, chunk.key, attempt)
    except Exception:  # noqa: BLE001 - the connection may be what failed; unclaimed is the safe side
        log.warning("chunk %s: could not check whether the failed detach left %s pending", chunk.key, planned)


def _plain_detach(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    table: TableName,
    cutoffs: TenantCutoffs,
    step: Callable[[str], None],
) -> PartitionOutcome | None:
    """The detach in one transaction (a condition or a tenant rule to prove under lock, or a DEFAULT
    partition, with which PostgreSQL refuses CONCURRENTLY): the parent's lock first, then the partition's,
    the order in which writers through the parent take theirs, so that the two never deadlock: SHARE while
    the rows are proved again (writers wait, readers go on), ACCESS EXCLUSIVE on the parent only for the
    plain DETACH itself; the claim in the same commit. The count, the drop or the move
    follow in :func:`_finish`, after the parent's lock is released. None once detached; the outcome when
    the partition is kept."""
    assert chunk.partition_oid is not None
    planned = table
    check = needs_row_check(policy)
    holds_kept = False
    if check:
        # First without any lock that makes writers wait: a partition that keeps a row never locks its
        # parent. Stops at the first such row.
        (holds_kept,) = dbapi.fetch_all(
            conn,
            ineligible_exists_statement(policy, target, planned),
            cutoffs.params(),
            lock_timeout_ms=policy.lock_timeout_ms,
        )[0]
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        row = ledger.lock_chunk(cur, run_key, chunk.key)
        if row is None or row[0] == "complete":
            return PartitionOutcome(0, "", already_complete=True)
        if holds_kept:
            return _keep(cur, ledger, run_key, chunk, attempt, planned, _HOLDS_KEPT)
        before = partition_state(cur, policy, chunk.partition_oid)
        if before is None or before.parent is None or before.pending_detach or before.table.name != planned.name:
            raise RetryableError(
                f"chunk {chunk.key}: partition {planned} changed before its detach; the retry looks again"
            )
        # Each wait is bounded by lock_timeout: a timeout rolls back this transaction, nothing is detached.
        # SHARE while the rows are checked: writers wait (parent first, their order), readers go on; the
        # check may read the whole partition, and an ACCESS EXCLUSIVE held that long would stop every
        # query on the table.
        cur.execute(lock_statement(before.parent, "SHARE", only=True))
        cur.execute(lock_statement(before.table, "SHARE"))
        state = partition_state(cur, policy, chunk.partition_oid)
        if state != before:
            raise RetryableError(
                f"chunk {chunk.key}: partition {planned} changed while its detach took its locks; the retry looks again"
            )
        assert state is not None and state.parent is not None
        if not expired_by_bound(cur, policy, target, cutoffs, chunk.partition_oid):
            return _keep(cur, ledger, run_key, chunk, attempt, planned, _NOT_EXPIRED)
        if check:
            cur.execute(ineligible_exists_statement(policy, target, state.table), cutoffs.params())
            if cur.fetchone()[0]:
                return _keep(cur, ledger, run_key, chunk, attempt, planned, _HOLDS_KEPT)
        step("before_detach")
        # Only the DETACH itself holds ACCESS EXCLUSIVE (parent first, then the partition, as DETACH takes
        # them), until the commit a few milliseconds later. Writers queued on the SHARE locks hold nothing
        # of the two, so the upgrade waits for readers only, bounded by lock_timeout.
        cur.execute(lock_statement(state.parent, "ACCESS EXCLUSIVE", only=True))
        why = "condition checked under lock" if check else "a DEFAULT partition forbids CONCURRENTLY"
        log.info("chunk %s: ALTER TABLE %s DETACH PARTITION %s (%s)", chunk.key, state.parent, state.table, why)
        cur.execute(detach_statement(state.parent, state.table, ""))
        ledger.start_action(cur, run_key, chunk.key, attempt)  # ours, in the detach's own commit
    return None


_HOLDS_KEPT = (
    "it holds a row the condition or the tenant rule keeps (changed since planning); its eligible rows are deleted"
    " in batches by the next run"
)


def _finish(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    run_key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    planned: TableName,
    action: str | None,
    cutoffs: TenantCutoffs,
) -> PartitionOutcome:
    """After this chunk's detach: count the detached table (per tenant too) and prove every row of it
    eligible, drop or move it, complete the ledger, in one commit. A table holding a row the policy keeps
    is left detached as it is (``kept``), never dropped."""
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
            # Re-attached since the detach: the retry sees it attached, and detaches it again.
            raise RetryableError(f"chunk {chunk.key}: partition {planned} was attached again during its detach")
        if action is None:
            return _keep(
                cur,
                ledger,
                run_key,
                chunk,
                attempt,
                planned,
                f"this chunk detached it before the policy changed; it is left detached as {state.table}, not dropped",
            )
        # The table is no longer the policy's: only a direct write could change it, and it waits now.
        cur.execute(lock_statement(state.table, "ACCESS EXCLUSIVE"))
        counted = census(cur, policy, target, cutoffs, state.table)
        if counted.kept:
            return _keep(
                cur,
                ledger,
                run_key,
                chunk,
                attempt,
                planned,
                f"detached as {state.table}, but {counted.kept} of its {counted.rows} row(s) are not eligible at the"
                " cutoff: left detached as it is, not dropped (re-attach it: ALTER TABLE … ATTACH PARTITION)",
            )
        outcome = _remove(cur, policy, action, state.table)
        ledger.add_tenant_counts(cur, run_key, chunk.key, [(t, n, 0, 0) for t, n in counted.tenants])
        _complete(cur, ledger, run_key, chunk, attempt, counted.rows, outcome)
    log.info("chunk %s: partition %s %s with %d row(s)", chunk.key, planned, outcome, counted.rows)
    return PartitionOutcome(counted.rows, outcome, how="detached, counted and proved")


def _remove(cur: Any, policy: RetentionPolicy, action: str, table: TableName) -> str:
    """Drop the detached table, or leave it detached (moved into ``detached_schema``, under names that
    cannot clash there); either way it is no longer pg_partman's to maintain (:func:`partman.forget`)."""
    partman.forget(cur, table)
    if action == "drop":
        cur.execute(drop_statement(table))
        return "dropped"
    if policy.detached_schema is not None and table.schema != policy.detached_schema:
        moved = move_to_schema(cur, table, policy.detached_schema)
        log.info("partition %s moved to %s", table, moved)
    return "detached"


def _complete(
    cur: Any, ledger: Ledger, run_key: str, chunk: ChunkSpec, attempt: Attempt, rows: int, outcome: str
) -> None:
    ledger.complete_chunk(cur, run_key, chunk, attempt, outcome=outcome, deleted=rows)
