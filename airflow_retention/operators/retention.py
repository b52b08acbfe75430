"""Operators of airflow-retention: plan a run, purge one chunk, vacuum after a run. What a task reads from
its Airflow context (the run's date and cutoff, who runs this try) is in :mod:`.context`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_retention import metrics
from airflow_retention.compat import AirflowFailException, conf
from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError, PolicyError
from airflow_retention.core.ledger.records import BLOCK_CHUNK_PREFIX, ChunkSpec
from airflow_retention.core.planning.cutoff import format_cutoff, freeze_cutoff, parse_cutoff
from airflow_retention.core.planning.walkers.keys import chunk_key as make_chunk_key
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import ChunkResult
from airflow_retention.core.running.verify import Leftovers
from airflow_retention.hooks.retention import RetentionHook
from airflow_retention.lineage import OpenLineageFacets
from airflow_retention.operators.context import anchor_from_context, attempt_from_context

if TYPE_CHECKING:
    from airflow.sdk import Context

RUN_XCOM_KEY = "run"
# The label of a mapped chunk task in the UI. Airflow renders it before ``execute`` (3.2+: the label while
# it runs) and again after it with the same context, on success and on failure (3.0.2+): a chunk that
# ran puts its range and result under ``chunk_label``; one that failed keeps the range alone.
CHUNK_LABEL_TEMPLATE = "{{ chunk_label if chunk_label is defined else task.chunk_label }}"


def outcome_text(result: ChunkResult, *, dry_run: bool, chunk_rows_deleted: int | None = None) -> str:
    """What a chunk did, in a few words for its label: "12,067 deleted". ``chunk_rows_deleted`` is the
    ledger's total for a chunk that earlier tries had begun (this try's count is only the rest)."""
    if result.already_complete:
        return "already complete"
    if dry_run:
        return f"{result.rows_matched:,} would be deleted"
    if result.outcome == "partition_gone":
        return "partition gone, 0 deleted"
    if result.outcome == "kept":
        return "partition kept, 0 deleted"
    if result.outcome == "detached":
        return f"{result.rows_deleted:,} detached"
    if chunk_rows_deleted is not None and chunk_rows_deleted != result.rows_deleted:
        return f"{chunk_rows_deleted:,} deleted ({result.rows_deleted:,} on this try)"
    archived = f", {result.rows_archived:,} archived" if result.rows_archived else ""
    return f"{result.rows_deleted:,} deleted{archived}"


def report_lag(log: Any, policy: RetentionPolicy, run_key: str, cutoff: datetime, leftovers: Leftovers) -> None:
    """Send a run's measured cleanup lag as metrics and say it in the task log (a warning when rows are
    left)."""
    metrics.cleanup_lag(policy, leftovers.lag_seconds, leftovers.count)
    if leftovers.count and not policy.dry_run:
        log.warning(
            "run %s: %s. Rows of tenants deferred by max_rows_per_tenant, or inserted or reopened with old"
            " timestamps after planning, are left; the next run picks them up",
            run_key,
            leftovers.describe(cutoff),
        )
    else:
        log.info("run %s: %s", run_key, leftovers.describe(cutoff))


def range_problem(
    policy: RetentionPolicy,
    *,
    keys: Sequence[Any] | None,
    blocks: Sequence[Any] | None,
    bare: bool,
    tenants: Sequence[Any] | None,
    from_plan: bool,
    partition: str | None,
    action: str | None,
) -> str | None:
    """What is wrong with the way a chunk task is given its range, in words naming the fields; None when
    nothing is. Bare ``lo``/``hi`` are the planner's (its unit is the plan's) or a partition's blocks: a
    lone chunk of a whole table must say which it means, since with ``chunk_by: block`` (the default)
    ``lo=0, hi=1_000_000`` would be the first million blocks, not the ids below a million."""
    given = [name for name, value in (("keys", keys), ("blocks", blocks)) if value is not None]
    if len(given) > 1 or (given and bare):
        shown = " and ".join(given + (["lo/hi"] if bare else []))
        return f"the range is given twice ({shown}): give one of keys=(lo, hi) or blocks=(lo, hi)"
    pair = keys if keys is not None else blocks
    if pair is not None and (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2):
        return f"{given[0]} must be a pair (lo, hi), got {pair!r}"
    if keys is not None:
        if policy.key_column is None:
            return (
                f"keys=(lo, hi) is a range of the policy's key_column, and policy {policy.name!r} has none (its"
                f" chunks are blocks of {policy.table}): set key_column, or give blocks=(lo, hi)"
            )
        if partition is not None:
            return "keys=(lo, hi) with partition=: a partition's chunk is a range of its blocks; give blocks=(lo, hi)"
    if blocks is not None and tenants is not None:
        return (
            "tenants= with blocks=(lo, hi): a block range purges every tenant's eligible rows in its blocks;"
            " give keys=(lo, hi) to purge some tenants only"
        )
    if action is not None or given:
        return None
    if not bare:
        return "no range: give keys=(lo, hi) (a range of the key column) or blocks=(lo, hi) (of the table's blocks)"
    if not from_plan and partition is None:
        unit = "block numbers" if policy.chunk_by == "block" else "keys"
        return (
            f"bare lo/hi are ambiguous for a lone chunk: their meaning depends on the policy's chunk_by"
            f" ({policy.chunk_by!r}: here they would be {unit}). Give keys=(lo, hi) for a range of"
            f" {policy.key_column or 'the key column'}, or blocks=(lo, hi) for the table's physical blocks"
        )
    return None


def fail_fast(exc: Exception) -> AirflowFailException:
    """A problem no retry can fix fails the task at once, with the core's message."""
    return AirflowFailException(str(exc))


class RetentionPlanOperator(OpenLineageFacets, BaseOperator):
    """Freeze the run's cutoff, ensure the ledger, register the run and plan its chunks.

    Returns the plan as a list of keyword-argument dicts for
    ``RetentionChunkOperator.partial(...).expand_kwargs(...)`` and pushes a small run summary under the
    XCom key ``run`` for ``RetentionCompleteSensor``. A cleared
    or retried planner of the same run returns the plan stored in the ledger.

    :param policy: the retention policy.
    :param max_chunks: the most chunks to plan; default Airflow's ``[core] max_map_length``.
    """

    template_fields: Sequence[str] = ()
    ui_color = "#e8f0fe"
    lineage_kind = "plan"  # its OpenLineage facets (airflow_retention.lineage)

    def __init__(self, *, policy: RetentionPolicy, max_chunks: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.policy = policy
        self.max_chunks = max_chunks

    @cached_property
    def hook(self) -> RetentionHook:
        return RetentionHook(policy=self.policy)

    def execute(self, context: Context) -> list[dict[str, Any]]:
        limit = conf.getint("core", "max_map_length", fallback=1024)
        max_chunks = min(self.max_chunks or limit, limit)
        self._measure_previous_lag()
        try:
            run_date = anchor_from_context(context)
            cutoff = freeze_cutoff(self.policy, run_date)
            self.log.info(
                "policy %s: cutoff frozen at %s (run date minus %s)",
                self.policy.name,
                format_cutoff(cutoff),
                self.policy.retention,
            )
            started = time.perf_counter()
            plan = self.hook.plan(
                cutoff, max_chunks=max_chunks, planned_by=attempt_from_context(context).label(), run_date=run_date
            )
            planning_seconds = time.perf_counter() - started
        except (PermanentError, PolicyError) as exc:
            raise fail_fast(exc) from exc
        self.log.info(
            "run %s: %s %d chunk(s), %s row(s) eligible at planning, chunk_rows %d, in %.2f s",
            plan.run_key,
            "reusing the stored plan of" if plan.reused else "planned",
            len(plan.chunks),
            f"~{plan.rows_planned}" if plan.rows_estimated else plan.rows_planned,  # "~": a sample's estimate
            plan.chunk_rows,
            planning_seconds,
        )
        if not plan.chunks:
            self.log.info("run %s: nothing eligible; recorded complete with 0 rows", plan.run_key)
        run = {
            "run_key": plan.run_key,
            "cutoff": format_cutoff(plan.cutoff),
            "chunk_keys": [c.key for c in plan.chunks],
            "rows_planned": plan.rows_planned,
            "planning_seconds": round(planning_seconds, 3),
            # The estimate and why this chunk count (None when the stored plan was reused).
            "sizing": plan.sizing.to_dict() if plan.sizing is not None else None,
        }
        context["ti"].xcom_push(key=RUN_XCOM_KEY, value=run)
        self.lineage_state = {**run, "chunks": len(plan.chunks)}
        return plan.expand_kwargs()

    def _measure_previous_lag(self) -> None:
        """Before this run deletes anything: the cleanup lag of the policy's previous run, when its verify
        left it to now (a large purge). A failure here is logged and does not hold up the run."""
        try:
            found = self.hook.measure_pending_lag()
        except Exception:
            self.log.warning("could not measure the cleanup lag of the previous run", exc_info=True)
            return
        if found is not None:
            run, leftovers = found
            self.log.info("the cleanup lag of the previous run %s, left to this run's planning:", run["run_key"])
            report_lag(self.log, self.policy, run["run_key"], run["cutoff"], leftovers)


class RetentionChunkOperator(OpenLineageFacets, BaseOperator):
    """Delete the eligible rows of one chunk in bounded batches, recording each batch in the ledger.

    Usually mapped over a plan: ``RetentionChunkOperator.partial(policy=...).expand_kwargs(plan.output)``;
    usable alone in any DAG with an explicit range, ``keys=(lo, hi)`` or ``blocks=(lo, hi)``. Returns a
    small summary (rows deleted, batches, seconds, already complete or not). A chunk already complete in
    the ledger is a no-op.

    :param policy: the retention policy.
    :param keys: a key range ``(lo, hi)`` of the policy's ``key_column``, ``lo`` inclusive, ``hi``
        exclusive, whatever the policy's ``chunk_by`` (the chunk then runs as ``chunk_by: key``).
    :param blocks: a range ``(lo, hi)`` of the table's (or ``partition``'s) physical blocks, whatever the
        policy's ``chunk_by``; every tenant's rows in them.
    :param lo: first of the range the planner gave (inclusive), in the unit of its plan: the policy's
        ``chunk_by``, or blocks of ``partition``. Refused for a lone chunk without ``partition``: there
        its meaning would depend on ``chunk_by`` (use ``keys`` or ``blocks``).
    :param hi: end of that range (exclusive).
    :param tenants: tenant values (as text) the chunk covers (key ranges only); None for every row in
        the range.
    :param cutoff: the run's frozen cutoff (ISO 8601); default: frozen from this run's date.
    :param chunk_key: the chunk's identity in the ledger; default derived from tenants and range.
    :param rows_planned: eligible rows at planning time, for the logs.
    :param from_plan: the chunk comes from a ``RetentionPlanOperator`` (as in
        ``retention_task_group``): it must be in the ledger's plan.
        Left False, the chunk is a lone one with a ledger run of its own (``<run key>#lone``).
    :param partition: of a partitioned table's chunk, the partition it works on (``schema.name``):
        its range is of that leaf's blocks, or ``action`` says what becomes of it.
    :param partition_oid: the partition's oid at planning: a partition renamed, detached or dropped
        since is recognised and left alone.
    :param action: ``"detach"`` or ``"drop"`` for a whole expired partition (no range); None to delete rows.
    :raises ValueError: when the DAG is parsed, for a range given twice, in no way, or as bare
        ``lo``/``hi`` of a lone chunk; ``keys`` without the policy's ``key_column`` or with a partition.
    """

    template_fields: Sequence[str] = ("cutoff", "keys", "blocks", "lo", "hi", "tenants", "chunk_key")
    ui_color = "#fce8e6"
    lineage_kind = "chunk"

    def __init__(
        self,
        *,
        policy: RetentionPolicy,
        keys: Sequence[int | str] | None = None,
        blocks: Sequence[int | str] | None = None,
        lo: int | str | None = None,
        hi: int | str | None = None,
        tenants: Sequence[Any] | None = None,
        cutoff: str | datetime | None = None,
        chunk_key: str | None = None,
        rows_planned: int | None = None,
        from_plan: bool = False,
        partition: str | None = None,
        partition_oid: int | None = None,
        action: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("map_index_template", CHUNK_LABEL_TEMPLATE)
        super().__init__(**kwargs)
        problem = range_problem(
            policy,
            keys=keys,
            blocks=blocks,
            bare=lo is not None or hi is not None,
            tenants=tenants,
            from_plan=from_plan,
            partition=partition,
            action=action,
        )
        if problem is not None:
            raise ValueError(f"RetentionChunkOperator {kwargs.get('task_id')!r} (policy {policy.name!r}): {problem}")
        self.policy = policy
        self.keys = keys
        self.blocks = blocks
        self.lo = lo
        self.hi = hi
        self.tenants = tenants
        self.cutoff = cutoff
        self.chunk_key = chunk_key
        self.rows_planned = rows_planned
        self.from_plan = from_plan
        self.partition = partition
        self.partition_oid = partition_oid
        self.action = action

    @cached_property
    def hook(self) -> RetentionHook:
        return RetentionHook(policy=self.policy)

    def _range(self) -> tuple[str, int, int]:
        """The chunk's range as integers, and its unit: ``"keys"``, ``"blocks"`` or ``"plan"`` (bare
        ``lo``/``hi``: the unit of the plan or of the partition)."""
        unit, pair = next(
            ((u, p) for u, p in (("keys", self.keys), ("blocks", self.blocks)) if p is not None),
            ("plan", (self.lo, self.hi)),
        )
        if self.action is not None and pair == (None, None):
            return "plan", 0, 1  # a whole partition: the range the planner records for it
        try:
            lo, hi = (int(v) for v in pair)  # type: ignore[arg-type, union-attr]
        except (TypeError, ValueError):
            shown = f"{unit}={pair!r}" if unit != "plan" else f"lo={self.lo!r} hi={self.hi!r}"
            raise AirflowFailException(f"chunk range must be two integers (lo, hi), got {shown}") from None
        return unit, lo, hi

    def _chunk(self) -> ChunkSpec:
        return self._chunk_and_policy()[1]

    def _chunk_and_policy(self) -> tuple[RetentionPolicy, ChunkSpec]:
        """The chunk, and the policy it runs under: a ``keys`` range of a policy that chunks by blocks
        runs with ``chunk_by: key``, a ``blocks`` range of one that chunks by keys with ``chunk_by: block``."""
        unit, lo, hi = self._range()
        tenants = tuple(str(t) for t in self.tenants) if self.tenants is not None else None
        policy = self.policy
        key = self.chunk_key
        if unit == "keys":
            if policy.chunk_by != "key":
                policy = dataclasses.replace(policy, chunk_by="key")
        elif unit == "blocks":
            if policy.chunk_by != "block":
                policy = dataclasses.replace(policy, chunk_by="block")
            at = f"@{TableName.parse(self.partition)}" if self.partition is not None else ""
            key = key or f"{BLOCK_CHUNK_PREFIX}{lo}-{hi}{at}"
        spec = ChunkSpec(
            key=key or make_chunk_key(tenants, lo, hi),
            lo=lo,
            hi=hi,
            tenants=tenants,
            rows_planned=self.rows_planned,
            partition=self.partition,
            partition_oid=int(self.partition_oid) if self.partition_oid is not None else None,
            action=self.action,
        )
        return policy, spec

    @property
    def chunk_label(self) -> str:
        """The chunk's range as the UI shows it instead of the map index: "tenant 7 · ids [120000, 130000)"."""
        try:
            return self._chunk().label()
        except AirflowFailException:
            return f"invalid range {self.keys or self.blocks or (self.lo, self.hi)!r}"

    def _rows_deleted_in_ledger(self, result: ChunkResult) -> int | None:
        """The chunk's rows deleted over all its tries, for the label; None when the ledger cannot say."""
        try:
            with self.hook.open_connection() as conn, dbapi.transaction(conn) as cur:
                row = self.hook.ledger.read_chunk(cur, result.run_key, result.chunk_key)
        except Exception:  # the label then shows this try's rows; nothing else depends on it
            self.log.warning("cannot read chunk %s from the ledger for its label", result.chunk_key, exc_info=True)
            return None
        return int(row[5]) if row is not None else None

    def execute(self, context: Context) -> dict[str, Any]:
        policy, chunk = self._chunk_and_policy()
        try:
            # The run's date itself goes with the cutoff frozen from it (per-tenant cutoffs are frozen
            # from it); a cutoff given explicitly comes without one.
            run_date = None if self.cutoff else anchor_from_context(context)
            cutoff = parse_cutoff(self.cutoff) if self.cutoff else freeze_cutoff(self.policy, run_date)
            self.log.info(
                "policy %s: chunk %s (ledger key %s), cutoff %s, first batch size %d%s",
                self.policy.name,
                chunk.label(),
                chunk.key,
                format_cutoff(cutoff),
                self.policy.batch_size,
                f", {chunk.rows_planned} row(s) eligible at planning" if chunk.rows_planned is not None else "",
            )
            attempt = attempt_from_context(context)
            if attempt.try_number and attempt.try_number > 1:
                metrics.chunk_retried(self.policy)
            result = self.hook.run_chunk(
                cutoff,
                chunk,
                attempt,
                lone=not self.from_plan,
                on_batch=lambda report: metrics.batch(self.policy, report),
                run_date=run_date,
                policy=policy,
            )
        except (PermanentError, PolicyError) as exc:
            raise fail_fast(exc) from exc
        if not result.already_complete:
            metrics.chunk_done(self.policy, result.seconds)
            metrics.paused(self.policy, result.paused)
            if result.outcome in ("dropped", "detached"):
                metrics.partition(self.policy, result.outcome, result.rows_deleted, result.seconds)
        summary = result.summary()
        self.lineage_state = {"policy": policy, "chunk": chunk, "cutoff": format_cutoff(cutoff), "summary": summary}
        total = self._rows_deleted_in_ledger(result) if result.resumed_from is not None else None
        # Read by CHUNK_LABEL_TEMPLATE when Airflow renders the label again after execute.
        context["chunk_label"] = (
            f"{chunk.label()} · {outcome_text(result, dry_run=self.policy.dry_run, chunk_rows_deleted=total)}"
        )
        if result.already_complete:
            self.log.info("chunk %s: already complete in the ledger; nothing deleted", chunk.label())
        else:
            self.log.info(
                "chunk %s: %s %d row(s) in %d batch(es), %.2f s, last batch size %s%s%s",
                chunk.label(),
                "would delete" if self.policy.dry_run else "deleted",
                result.rows_matched if self.policy.dry_run else result.rows_deleted,
                result.batches,
                result.seconds,
                result.last_batch_size,
                f", resumed from id {result.resumed_from}" if result.resumed_from is not None else "",
                f", paused {result.backoffs} time(s) for {result.backoff_seconds:.1f} s under database pressure"
                if result.backoffs
                else "",
            )
            if summary.get("top_tenants"):
                self.log.info(
                    "chunk %s: %d tenant(s); most rows: %s",
                    chunk.label(),
                    summary["tenants"],
                    ", ".join(f"{t} {n:,}" for t, n in summary["top_tenants"]),
                )
        return summary


class RetentionVacuumOperator(BaseOperator):
    """``VACUUM (ANALYZE)`` the policy's table after a run that deleted at least ``vacuum_after_rows``
    rows, so the space of the deleted rows is reusable and the planner's statistics are fresh. Runs
    outside any transaction; skipped (logged) for smaller runs and dry runs.

    :param policy: the retention policy (its ``vacuum_after_rows`` is the threshold).
    :param plan_task_id: task id of the planner whose ``run`` XCom names the run.
    """

    template_fields: Sequence[str] = ()
    ui_color = "#fef7e0"

    def __init__(self, *, policy: RetentionPolicy, plan_task_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.policy = policy
        self.plan_task_id = plan_task_id

    @cached_property
    def hook(self) -> RetentionHook:
        return RetentionHook(policy=self.policy)

    def execute(self, context: Context) -> dict[str, Any]:
        info = context["ti"].xcom_pull(task_ids=self.plan_task_id, key=RUN_XCOM_KEY) or {}
        run_key = info.get("run_key")
        run = self.hook.get_run(run_key) if run_key else None
        if run is None:
            raise AirflowFailException(f"policy {self.policy.name}: no run to vacuum after (plan XCom {info!r})")
        deleted = int(run["rows_deleted"] or 0)
        threshold = self.policy.vacuum_after_rows
        if run["vacuumed_at"] is not None:
            self.log.info(
                "run %s: the table was vacuumed after it at %s; no second VACUUM", run_key, run["vacuumed_at"]
            )
            return {"vacuumed": False, "rows_deleted": deleted}
        if self.policy.dry_run or threshold is None or deleted < threshold:
            self.log.info(
                "run %s deleted %d row(s), below vacuum_after_rows %s: no VACUUM", run_key, deleted, threshold
            )
            return {"vacuumed": False, "rows_deleted": deleted}
        self.log.info("run %s deleted %d row(s): VACUUM (ANALYZE) %s", run_key, deleted, self.policy.table)
        try:
            self.hook.vacuum(run_key)
        except (PermanentError, PolicyError) as exc:
            raise fail_fast(exc) from exc
        if run["lag_measured_at"] is None:
            # VACUUM removed the deleted rows' index entries: the walk the verify left is cheap now.
            try:
                leftovers = self.hook.measure_leftovers(run_key, run["cutoff"])
            except Exception:
                self.log.warning("could not measure the cleanup lag of run %s after VACUUM", run_key, exc_info=True)
            else:
                report_lag(self.log, self.policy, run_key, run["cutoff"], leftovers)
        return {"vacuumed": True, "rows_deleted": deleted}
