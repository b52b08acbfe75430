"""OpenLineage facets of the plan and chunk tasks, when ``apache-airflow-providers-openlineage`` is installed.

The operators get ``get_openlineage_facets_on_start`` and ``get_openlineage_facets_on_complete`` from
:class:`OpenLineageFacets`, the methods the OpenLineage provider's default extractor calls, as it does for
``SQLExecuteQueryOperator``. Nothing of OpenLineage is imported when this module loads: each call imports
it, and returns None when the provider is missing (the task itself never notices).

What a task reports (docs/lineage.md):

- datasets named as the Postgres provider names them (``PostgresHook.get_openlineage_database_info``):
  namespace ``postgres://host:port``, name ``database.schema.table``, the same table as the policy's asset
  ``postgres://host:port/database/schema/table``;
- the plan task: the target table as its input (it reads it to plan), and a ``retention`` run facet
  (:func:`facet_class`) with the run's key, cutoff, chunk count and rows planned;
- a chunk task: the target table as its output (with ``archive_table``, the archive table too, with its
  ``outputStatistics``: the rows archived), the batch statement as the ``sql`` job facet, and a
  ``retention`` run facet with the rows this attempt deleted (archived, matched) and its outcome. A
  partition chunk reports the partition as an output whose ``lifecycleStateChange`` is ``DROP`` when it
  was dropped, ``ALTER`` when it was detached, and ``ALTER TABLE … DETACH PARTITION …`` (and ``DROP TABLE
  …``) as its SQL.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from airflow_retention.compat import AirflowFailException
from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)
#: The key of the custom run facet.
FACET = "retention"


class OpenLineageFacets:
    """The OpenLineage methods of the plan and chunk operators. ``lineage_kind`` (``"plan"`` or
    ``"chunk"``) says what the task reports; ``execute`` leaves what it did in ``lineage_state``."""

    lineage_kind: str = ""
    lineage_state: dict[str, Any] | None = None

    def get_openlineage_facets_on_start(self) -> Any:
        return operator_lineage(self, complete=False)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        return operator_lineage(self, complete=True)


def operator_lineage(op: Any, *, complete: bool) -> Any:
    """The ``OperatorLineage`` of a plan or chunk task; None without the OpenLineage provider."""
    try:
        from airflow.providers.openlineage.extractors import OperatorLineage
    except ImportError:
        return None
    names = Names(op.policy)
    state = (op.lineage_state or {}) if complete else {}
    if op.lineage_kind == "plan":
        return OperatorLineage(
            inputs=[names.dataset(op.policy.table)], run_facets=_run_facet(op.policy, state, plan=True)
        )
    return _chunk_lineage(op, names, state, OperatorLineage)


class Names:
    """The OpenLineage names of a policy's tables, from its connection as the Postgres provider reads it."""

    def __init__(self, policy: RetentionPolicy) -> None:
        from airflow_retention.hooks.retention import RetentionHook

        self.hook = RetentionHook(policy=policy)
        info = self.hook.get_openlineage_database_info(self.hook.get_connection(policy.conn_id))
        self.namespace = f"{info.scheme}://{info.authority}"
        self.database = info.database
        self._schema: str | None = None

    def name(self, table: TableName) -> str:
        if table.schema is None and self._schema is None:  # the search_path decides: ask the database
            self._schema = self.hook.get_openlineage_default_schema()
        return f"{self.database}.{table.schema or self._schema}.{table.name}"

    def dataset(self, table: TableName, facets: dict[str, Any] | None = None) -> Any:
        from airflow.providers.common.compat.openlineage.facet import Dataset

        return Dataset(namespace=self.namespace, name=self.name(table), facets=facets or {})


def _chunk_lineage(op: Any, names: Names, state: dict[str, Any], operator_lineage_class: Any) -> Any:
    from airflow.providers.common.compat.openlineage.facet import (
        LifecycleStateChange,
        LifecycleStateChangeDatasetFacet,
        OutputStatisticsOutputDatasetFacet,
        SQLJobFacet,
    )

    policy, chunk = state.get("policy") or op.policy, state.get("chunk")
    if chunk is None:
        try:
            policy, chunk = op._chunk_and_policy()
        except AirflowFailException:  # a range that does not render to numbers: the task fails on it anyway
            chunk = None
    summary = state.get("summary") or {}
    inputs, outputs = [], [names.dataset(policy.table)]
    if policy.archive_table is not None and not policy.dry_run:
        inputs = [names.dataset(policy.table)]
        stats = {}
        if summary:
            stats = {"outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=summary.get("rows_archived", 0))}
        outputs.append(names.dataset(policy.archive_table, stats))
    sql = None
    if chunk is not None and chunk.action is not None and chunk.partition is not None:
        leaf = TableName.parse(chunk.partition)
        change = {"dropped": LifecycleStateChange.DROP, "detached": LifecycleStateChange.ALTER}.get(
            summary.get("outcome")
        )
        facets = {"lifecycleStateChange": LifecycleStateChangeDatasetFacet(lifecycleStateChange=change)}
        outputs.append(names.dataset(leaf, facets if change is not None else None))
        sql = partition_sql(policy, leaf, chunk.action)
    elif chunk is not None and state:
        sql = batch_sql(names.hook, policy, chunk)
    job_facets = {"sql": SQLJobFacet(query=sql)} if sql else {}
    run_facets = _run_facet(policy, state, chunk=chunk) if state else {}
    return operator_lineage_class(inputs=inputs, outputs=outputs, run_facets=run_facets, job_facets=job_facets)


def batch_sql(hook: Any, policy: RetentionPolicy, chunk: Any) -> str | None:
    """The text of the chunk's batch statement (the ``DELETE``, or a dry run's count), with its
    parameters as placeholders; it needs the catalog's facts about the table, read again here. None
    when they cannot be read: the lineage then goes without it."""
    from airflow_retention.core.db.catalog import inspect_target
    from airflow_retention.core.running.batches import RangeBatch, TenantPassBatch, statement_for

    try:
        with hook.open_connection() as conn:
            target = inspect_target(conn, policy, quiet=True, privileges=False)
            conn.rollback()
    except Exception:
        log.warning("cannot read %s's catalog for its lineage's SQL", policy.table, exc_info=True)
        return None
    statement = statement_for(policy, target, chunk)
    if isinstance(statement, TenantPassBatch):
        return statement.passes.delete or statement.passes.count
    return statement.text if isinstance(statement, RangeBatch) else None


def partition_sql(policy: RetentionPolicy, leaf: TableName, action: str) -> str:
    """What a partition chunk runs, as lineage shows it: the detach (from the policy's table; a partition
    of a sub-partitioned table is detached from its own parent), then the drop or the move."""
    from airflow_retention.core.sql.partitions import detach_statement, drop_statement

    steps = [detach_statement(policy.table, leaf, "CONCURRENTLY")]
    if action == "drop":
        steps.append(drop_statement(leaf))
    elif policy.detached_schema is not None:
        steps.append(f"ALTER TABLE {leaf.sql} SET SCHEMA {quote_ident(policy.detached_schema)}")
    return ";\n".join(steps)


@cache
def facet_class() -> type:
    """The ``retention`` run facet (an OpenLineage ``RunFacet``), made on first use: OpenLineage's classes
    are not imported before."""
    import attrs
    from airflow.providers.common.compat.openlineage.facet import RunFacet

    @attrs.define(kw_only=True)
    class RetentionRunFacet(RunFacet):
        """What a retention task did: the policy and its run; the plan's chunks and rows, or a chunk's
        rows deleted (archived, matched in a dry run) by this attempt and its outcome."""

        policy: str
        table: str
        runKey: str | None = None  # OpenLineage's facets are camelCase
        cutoff: str | None = None
        dryRun: bool = False
        chunks: int | None = None
        rowsPlanned: int | None = None
        chunkKey: str | None = None
        chunkLabel: str | None = None
        rowsDeleted: int | None = None
        rowsArchived: int | None = None
        rowsMatched: int | None = None
        batches: int | None = None
        alreadyComplete: bool | None = None
        outcome: str | None = None
        partition: str | None = None
        action: str | None = None

    return RetentionRunFacet


def _run_facet(policy: RetentionPolicy, state: dict[str, Any], *, plan: bool = False, chunk: Any = None) -> dict:
    if not state:
        return {}
    common = {"policy": policy.name, "table": str(policy.table), "cutoff": state.get("cutoff")}
    common["dryRun"] = policy.dry_run
    if plan:
        facet = facet_class()(
            **common, runKey=state.get("run_key"), chunks=state.get("chunks"), rowsPlanned=state.get("rows_planned")
        )
        return {FACET: facet}
    summary = state.get("summary") or {}
    facet = facet_class()(
        **common,
        runKey=summary.get("run_key"),
        chunkKey=summary.get("chunk_key"),
        chunkLabel=chunk.label() if chunk is not None else None,
        rowsDeleted=summary.get("rows_deleted"),
        rowsArchived=summary.get("rows_archived"),
        rowsMatched=summary.get("rows_matched"),
        batches=summary.get("batches"),
        alreadyComplete=summary.get("already_complete"),
        outcome=summary.get("outcome"),
        partition=chunk.partition if chunk is not None else None,
        action=chunk.action if chunk is not None else None,
    )
    return {FACET: facet}
