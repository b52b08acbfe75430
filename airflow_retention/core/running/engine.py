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
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError, RetentionError, RetryableError
from airflow_retention.core.ledger.ledger import Attempt, ChunkSpec, DeadLetter, Ledger, RunRecord, half_open
from airflow_retention.core.planning import tenants
from airflow_retention.core.planning.cutoff import (
    as_utc,
    format_cutoff,
    refuse_future_cutoff,
    resolve_run_date,
    run_key,
)
from airflow_retention.core.planning.planner import check_lone_range, freeze_tenant_cutoffs
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules
from airflow_retention.core.running.detach import gone_reason, partition_state, run_partition_chunk
from airflow_retention.core.running.isolation import TenantFailure, run_for_tenant, run_isolated
from airflow_retention.core.running.pacing import Pacer, Throttler, conflict_backoff
from airflow_retention.core.sql.statements import (
    BLOCK_COUNT,
    TenantBatch,
    batch_counts_tenants,
    batch_statement,
    batch_statement_returns_counts,
    batch_walk_statement,
    lock_statement,
    tenant_batch,
    tenants_in_batch_statement,
)
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)
# One-pass batches taken again after a concurrent change before the chunk gives up (the task's retry
# then resumes it): a row that keeps changing under the purge is a live row, not an expired one.
_MAX_CONFLICTS = 20


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
    if chunk.lo >= chunk.hi:
        raise PermanentError(f"chunk {chunk.key}: empty or inverted range [{chunk.lo}, {chunk.hi})")
    if chunk.tenants is not None and policy.tenant_column is None:
        raise PermanentError(f"chunk {chunk.key} names tenants but policy {policy.name!r} has no tenant_column")
    if (chunk.partition is None) != (chunk.partition_oid is None) or (chunk.action and chunk.partition is None):
        raise PermanentError(f"chunk {chunk.key}: a partition chunk needs partition, partition_oid and action")
    attempt = attempt or Attempt(host=default_host())
    ledger = ledger or Ledger(policy.ledger_schema)
    dbapi.prepare(conn)
    target = target or inspect_target(conn, policy)
    refuse_future_cutoff(conn, policy, cutoff)
    key = run_key(policy, cutoff, lone=lone)
    _ensure_chunk_row(conn, ledger, policy, cutoff, key, chunk, attempt, lone, run_date)
    if chunk.action is not None:
        return _partition_chunk(conn, policy, target, key, chunk, attempt, ledger, cutoff, on_step)

    by_block = policy.chunk_by == "block"
    leaf = TableName.parse(chunk.partition) if chunk.partition is not None else None
    walk = None if by_block else batch_walk_statement(policy, target, tenant_filter=chunk.tenants is not None)
    one_pass = batch_counts_tenants(policy)
    tenant_filter = chunk.tenants is not None
    statement = "" if one_pass else batch_statement(policy, target, tenant_filter=tenant_filter, relation=leaf)
    passes = tenant_batch(policy, target, leaf) if one_pass else None
    snapshot = passes is not None and passes.needs_snapshot
    conflicts = 0
    rng = rng or random.Random()
    result = ChunkResult(run_key=key, chunk_key=chunk.key)
    started = time.perf_counter()
    # A new chunk starts where the run's latest batches settled, not from scratch.
    pacer = Pacer.for_policy(
        policy,
        ledger.recent_batch_size(conn, key) if policy.target_batch_ms else None,
        label=f"chunk {chunk.key}",
        sleep=sleep,
    )
    throttler = Throttler(policy, label=f"chunk {chunk.key}", sleep=sleep)
    cutoffs = tenants.frozen(conn, ledger, policy, key, cutoff)
    params: dict[str, Any] = {**cutoffs.params(), "hi": chunk.hi, "only": None, "skip": []}
    tenants_statement = tenants_in_batch_statement(policy, target, leaf) if one_pass else ""
    returns_counts = batch_statement_returns_counts(policy)
    rows_per_block, end = 1.0, chunk.hi
    sync = None if policy.synchronous_commit == "server" else policy.synchronous_commit
    if by_block:
        try:
            blocks, rows_per_block = _block_extent(conn, leaf or policy.table)
        except PermanentError:
            if leaf is None:
                raise
            blocks, rows_per_block = chunk.hi, 50.0  # the leaf is gone: its first batch says so
        # Blocks past the table's end when the chunk starts hold no row yet: a range that runs past it
        # (a lone chunk given 0 to 2**62, a table truncated by VACUUM since planning) stops there.
        end = min(chunk.hi, blocks)
    try:
        while True:
            throttler.wait_until_calm(conn)
            size = pacer.next_size(conn)
            batch_started = time.perf_counter()
            locked = capped = False
            try:
                with dbapi.transaction(conn, repeatable_read=snapshot) as cur:
                    timeout_ms, wal = pacer.statement_timeout(size), target.wal_compression
                    # The policy's own statement_timeout while the batch waits for its locks; the cap
                    # (below) once they are held.
                    dbapi.set_local_timeouts(
                        cur,
                        policy.lock_timeout_ms,
                        policy.statement_timeout_ms,
                        wal_compression=wal,
                        synchronous_commit=sync,
                    )
                    row = ledger.lock_chunk(cur, key, chunk.key)
                    locked = True
                    if row is None:
                        raise PermanentError(f"chunk {chunk.key} of run {key} has no ledger row")
                    state, next_key, _, _, _, earlier_deleted, pos = row[:7]
                    if state == "complete":
                        result.already_complete = result.batches == 0
                        break
                    if leaf is not None and (gone := _leaf_gone(cur, policy, chunk, leaf)) is not None:
                        # Detached or dropped since planning: its rows are no longer the table's to purge.
                        log.warning(
                            "chunk %s: partition %s %s since planning: chunk complete, nothing more to delete there",
                            chunk.key,
                            leaf,
                            gone,
                        )
                        outcome = "deleted" if earlier_deleted else "partition_gone"
                        if sync == "off":
                            dbapi.durable_commit(cur)
                        ledger.complete_chunk(
                            cur, key, chunk, attempt, outcome=outcome, first_batch_of_attempt=result.batches == 0
                        )
                        result.batches += 1
                        break
                    if result.batches == 0:
                        resumed = next_key != chunk.lo or pos
                        result.resumed_from = next_key if resumed else None
                    # The cap and the batch's time start here, with the chunk's ledger row (and its leaf)
                    # locked: a wait behind another attempt's batch is not a slow batch, to be cut.
                    if timeout_ms != policy.statement_timeout_ms:
                        cur.execute("SELECT set_config('statement_timeout', %(t)s, true)", {"t": str(timeout_ms)})
                    batch_started, capped = time.perf_counter(), True
                    tenant = chunk.tenants[pos] if chunk.tenants is not None else None
                    batch = {**params, "lo": next_key, "limit": size, "tenant": tenant}
                    if policy.max_rows_per_tenant:
                        batch["xt"] = ledger.tenants_at_cap(cur, key, policy.max_rows_per_tenant)
                    failures: list[TenantFailure] = []
                    if policy.dry_run:
                        # Until the counts are read, a dry run's transaction cannot write: a statement that
                        # would delete fails instead (dbapi.begin_read_only says why not the whole batch).
                        dbapi.begin_read_only(cur)
                    if by_block:
                        # Blocks instead of keys: as many as hold about ``size`` rows.
                        upper = max(next_key, min(end, next_key + max(1, round(size / rows_per_block))))
                        last_key = upper - 1
                        batch.update(lo_tid=f"({next_key},0)", hi_tid=f"({upper},0)")
                        if one_pass:
                            batch["skip"] = [d["tenant"] for d in ledger.open_dead_letters(cur, key, chunk.key)]
                            assert passes is not None
                            per_tenant, failures = run_isolated(cur, passes, batch, tenants_statement)
                        else:
                            cur.execute(statement, batch)
                        full = upper < end
                    else:
                        assert walk is not None
                        cur.execute(walk, batch)
                        extent = cur.fetchone()
                        last_key = int(extent[0]) if extent is not None else chunk.hi - 1
                        full = extent is not None and last_key + 1 < chunk.hi
                        if tenant is not None:
                            counts, failure = run_for_tenant(
                                cur, statement, {**batch, "upper": last_key}, tenant, returns_counts=returns_counts
                            )
                            per_tenant = [(tenant, *counts)] if any(counts) else []
                            if failure is not None:
                                failures.append(failure)
                                full = False  # the tenant is left: the chunk goes on with its next one
                        else:
                            cur.execute(statement, {**batch, "upper": last_key})
                    if policy.dry_run:
                        dbapi.end_read_only(cur)  # the ledger writes below
                    if one_pass or tenant is not None:
                        deleted, archived, matched = _count_tenants(cur, ledger, key, chunk, per_tenant, result)
                        _dead_letters(cur, ledger, policy, key, chunk, cutoffs, failures)
                    elif returns_counts:
                        deleted, archived, matched = cur.fetchone()
                    else:
                        deleted, archived, matched = cur.rowcount, 0, 0
                    _check_archived(policy, chunk, deleted, archived)  # before the commit: a gap rolls it back
                    new_next, new_pos = (last_key + 1, pos) if full else (chunk.hi, pos)
                    if not full and chunk.tenants is not None and pos + 1 < len(chunk.tenants):
                        new_next, new_pos = chunk.lo, pos + 1  # this tenant is done: the next one from the start
                    exhausted = new_next >= chunk.hi
                    outcome = None
                    if exhausted:
                        total = earlier_deleted + deleted
                        outcome = "dry_run" if policy.dry_run else ("deleted" if total else "nothing_to_delete")
                    backoffs, backoff_s = throttler.take()
                    if exhausted and sync == "off":
                        # The chunk's receipt is durable once reported, and with it every batch before it.
                        dbapi.durable_commit(cur)
                    ledger.record_batch(
                        cur,
                        key,
                        chunk.key,
                        next_key=new_next,
                        tenant_pos=new_pos,
                        batch_size=size,
                        backoffs=backoffs,
                        backoff_seconds=backoff_s,
                        deleted=deleted,
                        archived=archived,
                        matched=matched,
                        complete=exhausted,
                        outcome=outcome,
                        attempt=attempt,
                        first_batch_of_attempt=result.batches == 0,
                    )
            except RetryableError as exc:
                # The statement cap cancelled a batch running long: nothing of it applied; the loop
                # takes its range again, a quarter as big.
                if capped and pacer.cut_short(exc, size, (time.perf_counter() - batch_started) * 1000):
                    result.batches_cut += 1
                    continue
                # A one-pass batch counts and deletes under one snapshot: a row changed by someone else
                # in between fails it as a whole, and it is taken again on a fresh snapshot. Failing on
                # the chunk's own ledger row means another attempt of the chunk committed a batch while
                # this one waited for it: not a conflict over rows, this attempt queues behind it.
                if not (snapshot and dbapi.sqlstate(exc.__cause__) == "40001"):
                    raise
                if locked:
                    conflicts += 1
                    if conflicts > _MAX_CONFLICTS:
                        raise
                    # Backoff with jitter: a writer that keeps changing the rows gets time to finish, and
                    # attempts that conflict with each other do not retry in lockstep.
                    pause = conflict_backoff(conflicts, rng)
                    log.info("chunk %s: a batch met a concurrent change (%s); taking it again on a fresh snapshot"
                             " in %.0f ms", chunk.key, " ".join(str(exc).split())[:200], pause * 1000)  # fmt: skip
                    sleep(pause)
                continue
            except PermanentError:
                # A leaf dropped between the batch's check and its lock: the next batch sees it gone.
                if leaf is None or not _leaf_vanished(conn, policy, chunk, leaf):
                    raise
                continue
            report = BatchReport(
                lo=next_key,
                hi=new_next if new_pos == pos else chunk.hi,
                tenant=tenant,
                size=size,
                deleted=deleted,
                archived=archived,
                matched=matched,
                ms=(time.perf_counter() - batch_started) * 1000,
                backoffs=backoffs,
                backoff_seconds=backoff_s,
            )
            pacer.observe(report.ms, full=full, size=size)
            result.batches += 1
            conflicts = 0  # consecutive conflicts: a batch went through
            result.rows_deleted += deleted
            result.rows_archived += archived
            result.rows_matched += matched
            result.backoffs += backoffs
            result.backoff_seconds += backoff_s
            result.last_batch_size = size
            result.batch_log.append(report)
            log.info(
                "chunk %s batch %d: %s%s %s %s %d of up to %d rows in %.0f ms%s",
                chunk.key,
                result.batches,
                f"tenant {tenant} " if tenant is not None else "",
                "blocks" if by_block else "ids",
                half_open(report.lo, report.hi),  # as ChunkSpec.label writes a range
                "would delete" if policy.dry_run else "deleted",
                matched if policy.dry_run else deleted,
                size,
                report.ms,
                " (chunk complete)" if exhausted else "",
            )
            if on_batch is not None:
                on_batch(report)
            if exhausted:
                break
            result.duty_seconds += pacer.rest(report.ms)
        if one_pass or chunk.tenants is not None:
            redo = _Redo(conn, policy, key, chunk, cutoffs, ledger, passes, statement, walk, tenants_statement, params,
                         result, target.wal_compression)  # fmt: skip
            redo.settle(end, rows_per_block, pacer.size)
    except RetentionError as exc:
        backoffs, backoff_s = throttler.take()
        ledger.record_error(
            conn, key, chunk.key, str(exc), policy.lock_timeout_ms, backoffs=backoffs, backoff_seconds=backoff_s
        )
        raise
    result.seconds = time.perf_counter() - started
    if result.already_complete:
        log.info("chunk %s of run %s is already complete in the ledger: nothing to do", chunk.key, key)
    return result


def _check_archived(policy: RetentionPolicy, chunk: ChunkSpec, deleted: int, archived: int) -> None:
    """Every row a batch deletes must reach the archive table in the same statement. A trigger or a rule
    on the archive can swallow rows (a BEFORE INSERT trigger returning NULL): the batch is then refused,
    and its transaction, deletions included, rolled back."""
    if policy.archive_table is None or policy.dry_run or int(archived) == int(deleted):
        return
    raise PermanentError(
        f"chunk {chunk.key}: a batch deleted {deleted} row(s) but archive_table {policy.archive_table} received"
        f" {archived}: a trigger or rule on {policy.archive_table} drops rows (a BEFORE INSERT trigger returning"
        " NULL, a DO INSTEAD rule). The batch was rolled back: nothing of it was deleted. Fix the archive table,"
        " then clear the chunk task"
    )


def _count_tenants(
    cur: Any, ledger: Ledger, key: str, chunk: ChunkSpec, per_tenant: list[tuple[Any, ...]], result: ChunkResult
) -> tuple[int, int, int]:
    """Add a one-pass batch's per-tenant rows to the ledger (same transaction) and to the attempt's
    tally; return the batch's totals (deleted, archived, matched)."""
    ledger.add_tenant_counts(cur, key, chunk.key, per_tenant)
    for tenant_value, n, _, m in per_tenant:
        result.tenant_rows[tenant_value] = result.tenant_rows.get(tenant_value, 0) + int(n) + int(m)
    deleted, archived, matched = (sum(int(r[i]) for r in per_tenant) for i in (1, 2, 3))
    return deleted, archived, matched


def _dead_letters(
    cur: Any,
    ledger: Ledger,
    policy: RetentionPolicy,
    key: str,
    chunk: ChunkSpec,
    cutoffs: tenants.TenantCutoffs,
    failures: list[TenantFailure],
) -> None:
    for failure in failures:
        log.warning(
            "chunk %s: tenant %s failed and is left out of the chunk (dead letter): %s; the other tenants go on",
            chunk.key,
            failure.tenant,
            failure.failure_class,
        )
        letter = DeadLetter(
            failure.tenant, cutoffs.cutoff_of(failure.tenant), failure.failure_class, failure.sqlstate, failure.message
        )
        ledger.record_dead_letter(cur, key, chunk, letter)


@dataclass
class _Redo:
    """A chunk's dead letters (tenants whose rows failed), after its range: a chunk that recorded some
    in this attempt fails naming them (its other tenants are purged); a chunk found complete with open
    dead letters (a retry, or a clear after the cause was fixed) deletes those tenants' eligible rows
    again, over its blocks (one pass) or each tenant's key range (key chunks that pack tenants), and
    resolves the dead letters of the tenants that now go through."""

    conn: Any
    policy: RetentionPolicy
    key: str
    chunk: ChunkSpec
    cutoffs: tenants.TenantCutoffs
    ledger: Ledger
    passes: TenantBatch | None  # one pass; else a key chunk's statement and walk
    statement: str
    walk: str | None
    tenants_statement: str
    params: dict[str, Any]
    result: ChunkResult
    wal_compression: str | None = None

    def open_letters(self) -> list[dict[str, Any]]:
        with dbapi.transaction(self.conn) as cur:
            return self.ledger.open_dead_letters(cur, self.key, self.chunk.key)

    def settle(self, end: int, rows_per_block: float, size: int) -> None:
        letters = self.open_letters()
        if not letters:
            return
        if self.result.already_complete:
            self.result.already_complete = False
            letters = self._again([d["tenant"] for d in letters], end, rows_per_block, size)
            if not letters:
                return
        shown = "; ".join(f"tenant {d['tenant']}: {d['failure_class']}" for d in letters[:5])
        raise PermanentError(
            f"chunk {self.chunk.key}: {len(letters)} tenant(s) could not be purged and were left (dead letters):"
            f" {shown}. The chunk's other tenants were purged. Fix the cause, then clear this chunk task: its"
            " retry purges only those tenants"
        )

    def _again(self, failed: list[str], end: int, rows_per_block: float, size: int) -> list[dict[str, Any]]:
        log.info("chunk %s: purging the rows of %d dead-lettered tenant(s) again: %s", self.chunk.key, len(failed),
                 ", ".join(failed[:10]))  # fmt: skip
        still: dict[str, TenantFailure] = {}  # a tenant that fails again is left out of the later batches
        if self.passes is not None:
            step = max(1, round(size / rows_per_block))
            for lo in range(self.chunk.lo, max(self.chunk.lo, end), step):
                going = [t for t in failed if t not in still]
                if not going:
                    break
                batch = {**self.params, "lo_tid": f"({lo},0)", "hi_tid": f"({min(end, lo + step)},0)"}
                with self._batch() as cur:
                    with dbapi.read_only(cur, self.policy.dry_run):
                        per_tenant, failures = run_isolated(cur, self.passes, batch, self.tenants_statement, only=going)
                    self._count(cur, per_tenant)
                still.update((f.tenant, f) for f in failures)
        else:
            for tenant in failed:
                if (failure := self._tenant_again(tenant, size)) is not None:
                    still[tenant] = failure
        with dbapi.transaction(self.conn) as cur:
            _dead_letters(cur, self.ledger, self.policy, self.key, self.chunk, self.cutoffs, list(still.values()))
            self.ledger.resolve_dead_letters(cur, self.key, self.chunk.key, [t for t in failed if t not in still])
            return self.ledger.open_dead_letters(cur, self.key, self.chunk.key)

    def _tenant_again(self, tenant: str, size: int) -> TenantFailure | None:
        """One tenant's key range of the chunk again, in batches; its failure if it fails again."""
        assert self.walk is not None
        returns_counts = batch_statement_returns_counts(self.policy)
        lo = self.chunk.lo
        while lo < self.chunk.hi:
            with self._batch() as cur:
                batch = {**self.params, "lo": lo, "limit": size, "tenant": tenant}
                cur.execute(self.walk, batch)
                extent = cur.fetchone()
                last = int(extent[0]) if extent is not None else self.chunk.hi - 1
                batch["upper"] = last
                with dbapi.read_only(cur, self.policy.dry_run):
                    counts, failure = run_for_tenant(cur, self.statement, batch, tenant, returns_counts=returns_counts)
                if failure is not None:
                    return failure
                self._count(cur, [(tenant, *counts)] if any(counts) else [])
            if extent is None:
                break
            lo = last + 1
        return None

    @contextmanager
    def _batch(self) -> Iterator[Any]:
        snapshot = self.passes is not None and self.passes.needs_snapshot
        with dbapi.transaction(self.conn, repeatable_read=snapshot) as cur:
            dbapi.set_local_timeouts(
                cur, self.policy.lock_timeout_ms, self.policy.statement_timeout_ms, wal_compression=self.wal_compression
            )
            self.ledger.lock_chunk(cur, self.key, self.chunk.key)  # attempts of one chunk queue here
            yield cur

    def _count(self, cur: Any, per_tenant: list[tuple[Any, ...]]) -> None:
        deleted, archived, _ = _count_tenants(cur, self.ledger, self.key, self.chunk, per_tenant, self.result)
        _check_archived(self.policy, self.chunk, deleted, archived)
        self.ledger.add_redone_rows(cur, self.key, self.chunk.key, deleted)
        self.result.rows_deleted += deleted


def _leaf_vanished(conn: Any, policy: RetentionPolicy, chunk: ChunkSpec, leaf: TableName) -> bool:
    with dbapi.transaction(conn) as cur:
        assert chunk.partition_oid is not None
        return gone_reason(partition_state(cur, policy, chunk.partition_oid), leaf) is not None


def _leaf_gone(cur: Any, policy: RetentionPolicy, chunk: ChunkSpec, leaf: TableName) -> str | None:
    """Why the chunk's leaf partition can no longer be purged (dropped, detached, renamed), or None after
    locking it for the batch: with ROW EXCLUSIVE (a dry run: ACCESS SHARE) held, a concurrent DETACH cannot
    finish mid-batch."""
    assert chunk.partition_oid is not None
    reason = gone_reason(partition_state(cur, policy, chunk.partition_oid), leaf)
    if reason is not None:
        return reason
    # A dry run only reads: ACCESS SHARE also keeps a DETACH from finishing, and needs no write privilege.
    cur.execute(lock_statement(leaf, "ACCESS SHARE" if policy.dry_run else "ROW EXCLUSIVE"))
    return gone_reason(partition_state(cur, policy, chunk.partition_oid), leaf)


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


def _block_extent(conn: Any, relation: TableName) -> tuple[int, float]:
    """The table's size in blocks now, and its rows per block by the server's estimate (to turn a batch
    size into blocks)."""
    blocks, reltuples, _ = dbapi.fetch_all(conn, BLOCK_COUNT, {"rel": relation.regclass_literal})[0]
    if not blocks or reltuples is None or reltuples <= 0:
        return int(blocks or 0), 50.0  # never analysed: a guess, corrected by the adaptive batch size
    return int(blocks), max(1.0, float(reltuples) / float(blocks))


def _ensure_chunk_row(
    conn: Any,
    ledger: Ledger,
    policy: RetentionPolicy,
    cutoff: datetime,
    key: str,
    chunk: ChunkSpec,
    attempt: Attempt,
    lone: bool,
    run_date: datetime | None = None,
) -> None:
    """Check the chunk's ledger row before any delete. A planned chunk must be in its run's stored plan;
    a lone chunk (no planner) creates its own run and chunk rows. Either way a row already there must
    describe the same range: a chunk key never stands for other rows."""
    ledger.ensure(conn)
    overrides: tuple[tuple[str, str, datetime, str], ...] = ()
    if lone:
        run_date = resolve_run_date(policy, cutoff, run_date)
        with dbapi.transaction(conn) as cur:
            known = ledger.read_chunk(cur, key, chunk.key) is not None
        if not known:  # checked once, before its first ledger row: a table shrunk since does not fail a retry
            check_lone_range(conn, policy, chunk)
            if chunk.tenants:
                # A tenant the column would store as another value ('acmecorp' in a char(4)) would purge
                # that other tenant's rows, counted under the name given: refused, as in the maps.
                tenants.as_printed(conn, policy, inspect_target(conn, policy), list(chunk.tenants), "tenants")
    if lone and has_per_tenant_rules(policy):
        # No planner froze this run's tenant cutoffs: freeze them now, from the run's own date.
        overrides = freeze_tenant_cutoffs(conn, policy, inspect_target(conn, policy), cutoff, run_date).overrides
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        if lone:
            ledger.register_run(
                cur,
                RunRecord.of(
                    policy,
                    key,
                    cutoff,
                    chunk_rows=policy.chunk_rows or 0,
                    chunks_expected=0,
                    rows_planned=0,
                    planned_by=f"lone chunk {chunk.key} ({attempt.label()})",
                    run_date=run_date,
                ),
                complete_if_empty=False,
            )
            ledger.insert_chunk(cur, key, chunk)
            if overrides:
                ledger.record_tenant_cutoffs(cur, key, overrides)
        # Only read: a zombie may hold the row's lock for a batch; the batch loop waits at most lock_timeout.
        stored = ledger.read_chunk(cur, key, chunk.key)
    if stored is None:
        raise PermanentError(
            f"chunk {chunk.key} is not in the ledger's plan of run {key}: the run was never planned, or its"
            " ledger rows were deleted. Re-plan the run (clear its plan task), or run the chunk as a lone chunk"
        )
    _, _, lo, hi, listed, _, _, partition, partition_oid, action, _ = stored
    recorded = (lo, hi, tuple(listed) if listed is not None else None, partition, partition_oid, action)
    if recorded != (chunk.lo, chunk.hi, chunk.tenants, chunk.partition, chunk.partition_oid, chunk.action):
        raise PermanentError(
            f"chunk key {chunk.key!r} of run {key} is recorded with tenants {listed} and range [{lo}, {hi})"
            f" (partition {partition}, action {action}), not {chunk.tenants} [{chunk.lo}, {chunk.hi})"
            f" (partition {chunk.partition}, action {chunk.action}); chunk keys must identify one range"
        )
    log.debug("chunk %s of run %s (cutoff %s) is in the ledger", chunk.key, key, format_cutoff(cutoff))
