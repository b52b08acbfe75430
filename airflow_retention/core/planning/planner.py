"""The planner: turn a policy and a frozen cutoff into a deterministic set of chunks, once per run.

The walker of the table's shape cuts it (:mod:`.walkers`): block ranges of the table, key ranges per
tenant, or whole partitions and the leaves' block ranges of a partitioned table. :func:`plan_run`
records the plan in the ledger once; a later call for the same run returns the stored plan.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import BLOCK_CHUNK_PREFIX, RunRecord
from airflow_retention.core.planning.cutoff import (
    as_utc,
    refuse_future_cutoff,
    resolve_run_date,
    run_key,
)
from airflow_retention.core.planning.plans import Plan, Preview
from airflow_retention.core.planning.tenants import TenantCutoffs, freeze_tenant_cutoffs
from airflow_retention.core.planning.walkers.blocks import plan_blocks
from airflow_retention.core.planning.walkers.keys import plan_keys
from airflow_retention.core.planning.walkers.partitions import plan_partitioned
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


def compute_plan(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    *,
    max_chunks: int = 1024,
    target: TargetInfo | None = None,
    run_date: datetime | None = None,
) -> Preview:
    """Count the eligible rows and cut them into chunks; reads only (no ledger, no writes).

    :param run_date: the run's date, the cutoff frozen from it: per-tenant cutoffs are frozen from it.
        Without it a policy with per-tenant retention is planned only when the cutoff tells the date
        (:func:`~airflow_retention.core.planning.cutoff.resolve_run_date`)."""
    cutoff = as_utc(cutoff)
    if max_chunks < 1:
        raise PermanentError(f"max_chunks must be at least 1, got {max_chunks}")
    dbapi.prepare(conn)
    target = target or inspect_target(conn, policy)
    refuse_future_cutoff(conn, policy, cutoff)
    run_date = resolve_run_date(policy, cutoff, run_date)
    cutoffs = freeze_tenant_cutoffs(conn, policy, target, cutoff, run_date)
    preview = _compute(conn, policy, target, cutoffs, max_chunks)
    return dataclasses.replace(preview, tenant_cutoffs=cutoffs, run_date=run_date)


def _compute(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    """The walker the policy's table is cut by plans the run."""
    if target.partitioned:
        return plan_partitioned(conn, policy, target, cutoffs, max_chunks)
    if policy.expired_partitions != "delete":
        log.warning(
            "policy %s: expired_partitions %r has no effect: %s is not a partitioned table",
            policy.name,
            policy.expired_partitions,
            policy.table,
        )
    if policy.chunk_by == "block":
        return plan_blocks(conn, policy, target, cutoffs, max_chunks)
    return plan_keys(conn, policy, target, cutoffs, max_chunks)


def plan_run(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    *,
    max_chunks: int = 1024,
    planned_by: str | None = None,
    target: TargetInfo | None = None,
    run_date: datetime | None = None,
) -> Plan:
    """Plan the run of ``policy`` at ``cutoff`` once; later calls for the same run key return the stored
    plan. Creates the ledger if needed and prunes the policy's runs older than ``ledger_keep_days``. A
    plan with no chunks records the run complete with zero rows. Per-tenant cutoffs are frozen from
    ``run_date`` (the date ``cutoff`` was frozen from; see :func:`compute_plan`) and recorded with the
    plan; the run's row records the date beside the cutoff."""
    cutoff = as_utc(cutoff)
    ledger = Ledger(policy.ledger_schema)
    dbapi.prepare(conn)
    # The target first: a policy pointed at the wrong database fails here and leaves no ledger schema behind.
    target = target or inspect_target(conn, policy)
    ledger.ensure(conn)
    key = run_key(policy, cutoff)
    stored = ledger.get_run(conn, key)
    if stored is not None:
        return _stored(conn, ledger, key, cutoff, stored)

    preview = compute_plan(conn, policy, cutoff, max_chunks=max_chunks, target=target, run_date=run_date)
    chunks, rows, size = preview.chunks, preview.rows_planned, preview.chunk_rows
    with dbapi.transaction(conn) as cur:
        created = ledger.register_run(
            cur,
            RunRecord.of(
                policy,
                key,
                cutoff,
                chunk_rows=size,
                chunks_expected=len(chunks),
                rows_planned=rows,
                planned_by=planned_by,
                run_date=preview.run_date,
                leaves_deferred=preview.leaves_deferred,
            ),
        )
        if created:
            ledger.insert_chunks(cur, key, chunks)
            if preview.tenant_cutoffs is not None:
                ledger.record_tenant_cutoffs(cur, key, preview.tenant_cutoffs.overrides)
    if not created:  # another planner of the same run won the race: its plan is the plan
        stored = ledger.get_run(conn, key)
        assert stored is not None
        return _stored(conn, ledger, key, cutoff, stored)
    log.info(
        "policy %s: run %s planned %d chunk(s)%s, %s eligible rows, chunk_rows %d%s",
        policy.name,
        key,
        len(chunks),
        # Key chunks of a policy with tenants only: block chunks take every tenant's rows in one pass.
        f" over {preview.tenant_groups} tenant group(s)" if policy.tenant_column and preview.tenant_groups else "",
        f"~{rows}" if preview.rows_estimated else rows,  # "~": a sample's estimate (Preview.rows_estimated)
        size,
        f"; {preview.sizing.reason}" if preview.sizing else "",
    )
    pruned = ledger.prune(conn, policy.name, policy.ledger_keep_days)
    ledger.forget_observations(conn, policy.ledger_keep_days)
    if pruned:
        log.info(
            "policy %s: pruned %d ledger run(s) last planned or completed more than %d days ago (ledger_keep_days)",
            policy.name,
            pruned,
            policy.ledger_keep_days,
        )
    return Plan(
        run_key=key,
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=rows,
        chunk_rows=size,
        reused=False,
        sizing=preview.sizing,
        rows_estimated=preview.rows_estimated,
    )


def _stored(conn: Any, ledger: Ledger, key: str, cutoff: datetime, run: dict[str, Any]) -> Plan:
    chunks = ledger.stored_plan(conn, key)
    log.info("run %s was planned before (%s): returning its %d stored chunk(s)", key, run["planned_at"], len(chunks))
    return Plan(
        run_key=key,
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=int(run["rows_planned"]),
        chunk_rows=int(run["chunk_rows"]),
        reused=True,
        # The ledger does not record how the rows were counted: key chunks always are (read_groups),
        # block and partition chunks may hold a sample's estimate.
        rows_estimated=any(c.key.startswith(BLOCK_CHUNK_PREFIX) or c.partition is not None for c in chunks),
    )
