"""Admitting a chunk before any delete: a planned chunk must be in its run's stored plan, a lone chunk
(run by hand, no planner) gets a run of its own; either way a chunk key never stands for other rows."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec, RunRecord
from airflow_retention.core.planning import tenants
from airflow_retention.core.planning.cutoff import format_cutoff, resolve_run_date
from airflow_retention.core.planning.probes import check_lone_range
from airflow_retention.core.planning.tenants import freeze_tenant_cutoffs
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules

log = logging.getLogger(__name__)


def check_chunk(policy: RetentionPolicy, chunk: ChunkSpec) -> None:
    """Refuse a chunk that cannot be what a plan makes (a hand-made one, or a corrupted XCom)."""
    if chunk.lo >= chunk.hi:
        raise PermanentError(f"chunk {chunk.key}: empty or inverted range [{chunk.lo}, {chunk.hi})")
    if chunk.tenants is not None and policy.tenant_column is None:
        raise PermanentError(f"chunk {chunk.key} names tenants but policy {policy.name!r} has no tenant_column")
    if (chunk.partition is None) != (chunk.partition_oid is None) or (chunk.action and chunk.partition is None):
        raise PermanentError(f"chunk {chunk.key}: a partition chunk needs partition, partition_oid and action")


def ensure_chunk_row(
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
