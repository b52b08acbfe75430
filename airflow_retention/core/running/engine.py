"""The chunk engine: delete one chunk's eligible rows in bounded batches, one transaction each.

Each batch transaction
  1. sets ``lock_timeout`` and ``statement_timeout`` for itself,
  2. locks the chunk's ledger row (attempts of one chunk, e.g. a zombie and its retry, queue here),
  3. reads the chunk's progress from that row (tenant and key), so a killed attempt resumes after its
     last commit,
  4. takes the next ``n`` keys of the range from there and deletes the eligible rows among them,
     re-checking the range, the cutoff and the condition in the DELETE itself (a row reopened since
     planning survives),
  5. advances the progress and counts, and marks the chunk complete when the range is exhausted,
and commits all of that at once. A replay of a complete chunk finds it complete and does nothing.

A chunk of several small tenants walks them one at a time, each along the (tenant, key) index.
Between batches the engine adapts ``n`` to the policy's target batch time and pauses while the
database is under pressure (:mod:`pacing`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError, RetentionError, RetryableError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec, half_open
from airflow_retention.core.planning import tenants
from airflow_retention.core.planning.cutoff import as_utc, refuse_future_cutoff, run_key
from airflow_retention.core.planning.walkers.base import Walker
from airflow_retention.core.planning.walkers.blocks import BlockWalker
from airflow_retention.core.planning.walkers.keys import KeyWalker, TenantKeyWalker
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.admission import check_chunk, ensure_chunk_row
from airflow_retention.core.running.batches import BatchStatement, Counts, check_archived, counts_tenants, statement_for
from airflow_retention.core.running.budget import SharedBudget, purge_session
from airflow_retention.core.running.context import BatchReport, ChunkResult, ChunkRun, default_host
from airflow_retention.core.running.detach import run_partition_chunk
from airflow_retention.core.running.pacing import Pacer, Throttler, conflict_backoff
from airflow_retention.core.running.progress import LedgerProgress, Progress, RedoProgress, leaf_vanished
from airflow_retention.core.sql.batches import batch_walk_statement
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)
# One-pass batches taken again after a concurrent change before the chunk gives up (the task's retry
# then resumes it): a row that keeps changing under the purge is a live row, not an expired one.
_MAX_CONFLICTS = 20

__all__ = ["BatchReport", "ChunkResult", "default_host", "run_chunk"]


def run_chunk(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    chunk: ChunkSpec,
    *,
    attempt: Attempt | None = None,
    target: TargetInfo | None = None,
    ledger: Ledger | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
    lone: bool = False,
    sleep: Callable[[float], None] = time.sleep,
    on_step: Callable[[str], None] | None = None,
    run_date: datetime | None = None,
    rng: random.Random | None = None,
) -> ChunkResult:
    """Delete the eligible rows of one chunk; safe to call any number of times, from any number of
    processes at once. Raises :class:`RetryableError` (nothing of the failed batch applied; retry
    resumes) or :class:`PermanentError` (retrying cannot help; nothing of the failed batch applied).

    :param conn: a DB-API connection (psycopg2 or psycopg 3) to the target database.
    :param cutoff: the run's frozen cutoff, an aware instant.
    :param chunk: tenants and key range, as planned by :func:`~airflow_retention.core.planning.planner.plan_run`.
    :param attempt: who runs it, recorded on completion.
    :param target: the checked catalog facts, when the caller has them already.
    :param on_batch: called after each committed batch.
    :param lone: the chunk was not planned: it gets a run of its own (key ``<run key>#lone``) and its
        ledger rows are created here, so it never alters a planned run's expected chunk set.
    :param sleep: how the throttle and the backoff after a serialization failure pause (tests pass a fake).
    :param on_step: partition chunks call it at ``"before_detach"`` and ``"after_detach"`` (fault drills).
    :param run_date: the run's date, ``cutoff`` frozen from it: a lone chunk freezes its run's per-tenant
        cutoffs from it and records it (a planned chunk's run has them already).
    :param rng: the jitter of the backoff after a serialization failure (tests pass a seeded one).
    """
    cutoff = as_utc(cutoff)
    check_chunk(policy, chunk)
    attempt = attempt or Attempt(host=default_host())
    ledger = ledger or Ledger(policy.ledger_schema)
    dbapi.prepare(conn)
    with purge_session(conn, ledger, policy):
        target = target or inspect_target(conn, policy)
        refuse_future_cutoff(conn, policy, cutoff)
        key = run_key(policy, cutoff, lone=lone)
        ensure_chunk_row(conn, ledger, policy, cutoff, key, chunk, attempt, lone, run_date)
        if chunk.action is not None:  # a whole partition: one step, no batches
            return _partition_chunk(conn, policy, target, key, chunk, attempt, ledger, cutoff, on_step)
        run = ChunkRun(
            conn,
            policy,
            target,
            ledger,
            key,
            chunk,
            attempt,
            cutoffs=tenants.frozen(conn, ledger, policy, key, cutoff),
            # A new chunk starts where the run's latest batches settled, not from scratch.
            pacer=Pacer.for_policy(
                policy,
                ledger.recent_batch_size(conn, key) if policy.target_batch_ms else None,
                label=f"chunk {chunk.key}",
                sleep=sleep,
            ),
            throttler=Throttler(policy, label=f"chunk {chunk.key}", sleep=sleep),
            budget=SharedBudget(
                policy,
                ledger,
                f"chunk {chunk.key}",
                f"{key} {chunk.key} ({attempt.label()})",
                tenant=chunk.tenants[0] if chunk.tenants is not None and len(chunk.tenants) == 1 else None,
                sleep=sleep,
            ),
            sleep=sleep,
            rng=rng or random.Random(),
            on_batch=on_batch,
        )
        started = time.perf_counter()
        try:
            walker, statement = walker_for(policy, target, chunk), statement_for(policy, target, chunk)
            walk(run, walker, statement, LedgerProgress(run, walker))
            if counts_tenants(policy, chunk) or chunk.tenants is not None:
                settle_dead_letters(run, statement)
        except RetentionError as exc:
            backoffs, backoff_s = run.throttler.take()
            ledger.record_error(
                conn,
                key,
                chunk.key,
                str(exc),
                policy.lock_timeout_ms,
                backoffs=backoffs,
                backoff_seconds=backoff_s,
                paused=run.paused_for_batch(),
            )
            raise
        run.result.seconds = time.perf_counter() - started
        if run.result.already_complete:
            log.info("chunk %s of run %s is already complete in the ledger: nothing to do", chunk.key, key)
        return run.result


def walker_for(
    policy: RetentionPolicy, target: TargetInfo, chunk: ChunkSpec, tenants: list[str] | None = None
) -> Walker:
    """The walker of a chunk's batches: blocks of the table or of the chunk's leaf, each listed tenant's
    key range in turn, or the key range (``tenants``: walk only these of the chunk's tenants)."""
    if policy.chunk_by == "block" or chunk.partition is not None:
        leaf = TableName.parse(chunk.partition) if chunk.partition is not None else None
        return BlockWalker(chunk, leaf or policy.table, leaf=leaf is not None)
    walk = batch_walk_statement(policy, target, tenant_filter=chunk.tenants is not None)
    if chunk.tenants is not None:
        return TenantKeyWalker(chunk, walk, tenants if tenants is not None else chunk.tenants)
    return KeyWalker(chunk, walk)


def walk(run: ChunkRun, walker: Walker, statement: BatchStatement, progress: Progress) -> None:
    """The chunk engine's one loop: pace, run one batch in its own transaction, record it; until the
    walker has no more batches or the chunk's ledger row says there is nothing left."""
    walker.open(run.conn)
    conflicts = 0  # consecutive batches that met a concurrent change
    try:
        while True:
            run.throttler.wait_until_calm(run.conn)
            run.budget.admit(run.conn)  # a batch slot of the database budget, held until after the rest
            if run.budget.enabled:
                run.pacer.aim_for(run.budget.duty(), run.budget.period_s)
            size = run.pacer.next_size(run.conn)
            try:
                done = _batch(run, walker, statement, progress, size)
            except _TakeAgain as again:
                run.budget.release(run.conn)
                if again.conflict:
                    conflicts += 1
                    _back_off(run, again.error, conflicts)
                continue
            if done is None:
                return
            report, full, exhausted = done
            conflicts = 0
            _tally(run, walker, report, full=full, exhausted=exhausted)
            if exhausted:
                return
            rest = run.pacer.rest(report.ms, run.budget.duty(), **run.budget.heartbeat(run.conn))
            run.budget.rested(rest)
            run.result.duty_seconds += rest
            run.budget.release(run.conn)
    finally:
        run.budget.release_quietly(run.conn)


def _back_off(run: ChunkRun, error: RetentionError, conflicts: int) -> None:
    """Before a batch that met a concurrent change is taken again: give up past :data:`_MAX_CONFLICTS`,
    else pause, with jitter, so that a writer that keeps changing the rows gets time to finish and
    attempts that conflict with each other do not retry in lockstep."""
    if conflicts > _MAX_CONFLICTS:
        raise error from error.__cause__
    pause = conflict_backoff(conflicts, run.rng)
    change = " ".join(str(error).split())[:200]
    log.info("chunk %s: a batch met a concurrent change (%s); taking it again on a fresh snapshot in %.0f ms",
             run.chunk.key, change, pause * 1000)  # fmt: skip
    run.sleep(pause)


class _TakeAgain(Exception):
    """The batch applied nothing and is taken again: cut short by the cap, a leaf dropped under it, or
    (``conflict``) a concurrent change under its snapshot."""

    def __init__(self, error: RetentionError, *, conflict: bool = False) -> None:
        super().__init__(str(error))
        self.error, self.conflict = error, conflict


def _batch(
    run: ChunkRun, walker: Walker, statement: BatchStatement, progress: Progress, size: int
) -> tuple[BatchReport, bool, bool] | None:
    """One batch, one transaction: lock the chunk's row, take the walker's next bounds, run the
    statement, record it. Returns its report, whether its range went on (a full batch, for the pacer)
    and whether the walk is over; None: nothing left to do."""
    policy, chunk = run.policy, run.chunk
    started, locked, capped = time.perf_counter(), False, False
    timeout_ms = run.pacer.statement_timeout(size)
    try:
        with dbapi.transaction(run.conn, repeatable_read=statement.snapshot) as cur:
            # The policy's own statement_timeout while the batch waits for its locks; the cap once held.
            dbapi.set_local_timeouts(
                cur,
                policy.lock_timeout_ms,
                policy.statement_timeout_ms,
                wal_compression=run.target.wal_compression,
                synchronous_commit=run.sync,
            )
            at = progress.lock(cur)
            locked = True
            if at is None or not progress.begin(cur, at):
                return None
            # The cap and the batch's time start here, with the chunk's ledger row (and its leaf) locked:
            # a wait behind another attempt's batch is not a slow batch, to be cut.
            if timeout_ms != policy.statement_timeout_ms:
                cur.execute("SELECT set_config('statement_timeout', %(t)s, true)", {"t": str(timeout_ms)})
            started, capped = time.perf_counter(), True
            batch = walker.next_batch(cur, at, size)
            params = {**run.params, **progress.params(cur), **batch.params}
            counts = _run_statement(cur, policy, statement, params)
            check_archived(policy, chunk, counts)  # before the commit: a gap rolls the batch back
            # A tenant whose rows failed is left: the chunk goes on with its next one.
            full = batch.full and not (counts.failures and batch.tenant is not None)
            after = walker.after(at, batch, tenant_done=not full and batch.full)
            exhausted = progress.record(cur, at, after, batch, counts, size)
        progress.committed()
    except RetryableError as exc:
        # The statement cap cancelled a batch running long: nothing of it applied; the loop takes its
        # range again, a quarter as big.
        if capped and run.pacer.cut_short(exc, size, (time.perf_counter() - started) * 1000):
            run.result.batches_cut += 1
            raise _TakeAgain(exc) from exc
        # A one-pass batch counts and deletes under one snapshot: a row changed by someone else in between
        # fails it as a whole, and it is taken again on a fresh snapshot. Failing on the chunk's own ledger
        # row means another attempt of the chunk committed a batch while this one waited for it: not a
        # conflict over rows, this attempt queues behind it.
        if not (statement.snapshot and dbapi.sqlstate(exc.__cause__) == "40001"):
            raise
        raise _TakeAgain(exc, conflict=locked) from exc
    except PermanentError as exc:
        # A leaf dropped between the batch's check and its lock: the next batch sees it gone.
        if chunk.partition is None or not leaf_vanished(run.conn, policy, chunk):
            raise
        raise _TakeAgain(exc) from exc
    report = BatchReport(
        lo=at.key,
        hi=after.key if after.tenant == at.tenant else chunk.hi,
        tenant=batch.tenant,
        size=size,
        deleted=counts.deleted,
        archived=counts.archived,
        matched=counts.matched,
        ms=(time.perf_counter() - started) * 1000,
        backoffs=run.backoffs[0],
        backoff_seconds=run.backoffs[1],
    )
    return report, full, exhausted


def _run_statement(cur: Any, policy: RetentionPolicy, statement: BatchStatement, params: dict[str, Any]) -> Counts:
    if not policy.dry_run:
        return statement.run(cur, params)
    # Until the counts are read, a dry run's transaction cannot write: a statement that would delete fails
    # instead (dbapi.begin_read_only says why not the whole batch).
    dbapi.begin_read_only(cur)
    counts = statement.run(cur, params)
    dbapi.end_read_only(cur)  # the ledger writes that follow
    return counts


def _tally(run: ChunkRun, walker: Walker, report: BatchReport, *, full: bool, exhausted: bool) -> None:
    """A committed batch: into the pacer, the attempt's result, the log and the caller's callback."""
    result = run.result
    run.pacer.observe(report.ms, full=full, size=report.size)
    run.pacer.ended(run.conn, report.size if full else 0)  # a batch cut short by its range says nothing
    result.batches += 1
    result.rows_deleted += report.deleted
    result.rows_archived += report.archived
    result.rows_matched += report.matched
    result.backoffs += report.backoffs
    result.backoff_seconds += report.backoff_seconds
    result.last_batch_size = report.size
    result.batch_log.append(report)
    log.info(
        "chunk %s batch %d: %s%s %s %s %d of up to %d rows in %.0f ms%s",
        run.chunk.key,
        result.batches,
        f"tenant {report.tenant} " if report.tenant is not None else "",
        walker.unit,
        half_open(report.lo, report.hi),  # as ChunkSpec.label writes a range
        "would delete" if run.policy.dry_run else "deleted",
        report.matched if run.policy.dry_run else report.deleted,
        report.size,
        report.ms,
        " (chunk complete)" if exhausted else "",
    )
    if run.on_batch is not None:
        run.on_batch(report)


def settle_dead_letters(run: ChunkRun, statement: BatchStatement) -> None:
    """A chunk's dead letters (tenants whose rows failed), after its range. A chunk that recorded some in
    this attempt fails naming them (its other tenants are purged). A chunk found complete with open dead
    letters (a retry, or a clear after the cause was fixed) walks again, the same loop over those
    tenants only (its blocks, or each tenant's key range), and resolves the tenants that now go through."""
    with dbapi.transaction(run.conn) as cur:
        letters = run.ledger.open_dead_letters(cur, run.key, run.chunk.key)
    if not letters:
        return
    if run.result.already_complete:
        run.result.already_complete = False
        failed = [d["tenant"] for d in letters]
        log.info("chunk %s: purging the rows of %d dead-lettered tenant(s) again: %s", run.chunk.key, len(failed),
                 ", ".join(failed[:10]))  # fmt: skip
        walker = walker_for(run.policy, run.target, run.chunk, tenants=failed)
        redo = RedoProgress(run, walker, failed)
        if run.policy.dry_run:
            redo.take_back_counted()
        walk(run, walker, statement, redo)
        letters = redo.settle()
        if not letters:
            return
    shown = "; ".join(f"tenant {d['tenant']}: {d['failure_class']}" for d in letters[:5])
    raise PermanentError(
        f"chunk {run.chunk.key}: {len(letters)} tenant(s) could not be purged and were left (dead letters):"
        f" {shown}. The chunk's other tenants were purged. Fix the cause, then clear this chunk task: its"
        " retry purges only those tenants"
    )


def _partition_chunk(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    ledger: Ledger,
    cutoff: datetime,
    on_step: Callable[[str], None] | None,
) -> ChunkResult:
    result = ChunkResult(run_key=key, chunk_key=chunk.key)
    started = time.perf_counter()
    try:
        cutoffs = tenants.frozen(conn, ledger, policy, key, cutoff)
        outcome = run_partition_chunk(
            conn, policy, target, key, chunk, attempt, ledger, cutoffs=cutoffs, on_step=on_step
        )
    except RetentionError as exc:
        ledger.record_error(conn, key, chunk.key, str(exc), policy.lock_timeout_ms)
        raise
    result.seconds = time.perf_counter() - started
    result.already_complete = outcome.already_complete
    result.outcome = outcome.outcome or None
    if policy.dry_run:
        result.rows_matched = outcome.rows
    else:
        result.rows_deleted = outcome.rows
    if not outcome.already_complete:
        # One step, not a batch: batch_log (and the batch metrics, longest batch) stay for real batches.
        result.batches = 1
        log.info(
            "chunk %s: %s %s: %s, %d row(s) (%s) in %.2f s",
            chunk.key,
            chunk.action,
            chunk.partition,
            outcome.outcome,
            outcome.rows,
            outcome.how,
            result.seconds,
        )
    else:
        log.info("chunk %s of run %s is already complete in the ledger: nothing to do", chunk.key, key)
    return result
