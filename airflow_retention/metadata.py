"""Airflow's own metadata database as retention policies: the rows ``airflow db clean`` would remove, read
from the cleanup configuration of the Airflow that is installed (``airflow.utils.db_cleanup.config_list``),
so that the policies follow the installed version rather than a copy that drifts.

One policy per table, in ``db clean``'s order (:func:`cleanup_order`: a table's ``dependent_tables``
before it), each with ``db clean``'s recency column as ``timestamp_column`` and its rules as ``condition``:

- ``extra_filters`` (compiled for PostgreSQL, the base table's alias renamed to the policy's);
- ``keep_last`` (a DAG's latest non-manual run, a DAG's latest version): the row is kept when its
  recency equals the latest of its group, exactly as ``db clean``'s outer join decides it;
- ``skip_if_referenced`` (a version still referenced by a task instance): ``NOT EXISTS``.

``ON DELETE CASCADE`` takes the dependent rows, as it does for ``db clean``. Where ``db clean`` would
touch rows of a run still running or queued, or fail on a ``RESTRICT`` foreign key, the policies add a
guard (:data:`GUARDS`): these are the only rows where the two differ (docs/airflow-metadata.md).

Per-DAG retention: ``dag_retention`` (DAG id → retention) makes ``dag_id`` the tenant column of every
table that has one (``db clean``'s ``dag_id_column_name``); the rows of such a table without a DAG id
get a second policy (``<name>_without_dag``) at the common retention.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_retention.core.policy.identifiers import quote_ident
from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)

# Rows db clean would delete that these policies keep: the rows of a run still running or queued (of the
# run, its task instances and what hangs off them), a DAG whose versions a task instance still references
# (db clean's delete fails on the RESTRICT key), and a trigger still in use (a deferred task, an asset
# watcher, a callback: Trigger.clean_unused's rule). Per table: the tables a guard reads, and its SQL;
# a guard is left out where the installed Airflow has no such table.
_LIVE = "live.state IN ('running', 'queued')"
_RUN_BY_KEYS = (
    "NOT EXISTS (SELECT 1 FROM {s}.dag_run AS live WHERE live.dag_id = {t}.dag_id AND live.run_id = {t}.run_id AND "
    + _LIVE
    + ")"
)
GUARDS: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "dag_run": [((), "{t}.state IS NULL OR {t}.state NOT IN ('running', 'queued')")],
    "task_instance": [(("dag_run",), _RUN_BY_KEYS)],
    "task_instance_history": [(("dag_run",), _RUN_BY_KEYS)],
    "xcom": [
        (
            ("dag_run",),
            "NOT EXISTS (SELECT 1 FROM {s}.dag_run AS live WHERE live.id = {t}.dag_run_id AND " + _LIVE + ")",
        )
    ],
    "task_state_store": [
        (
            ("dag_run",),
            "NOT EXISTS (SELECT 1 FROM {s}.dag_run AS live WHERE live.id = {t}.dag_run_id AND " + _LIVE + ")",
        )
    ],
    "deadline": [
        (("dag_run",), "NOT EXISTS (SELECT 1 FROM {s}.dag_run AS live WHERE live.id = {t}.dagrun_id AND " + _LIVE + ")")
    ],
    "task_reschedule": [
        (
            ("task_instance", "dag_run"),
            "NOT EXISTS (SELECT 1 FROM {s}.task_instance AS ti JOIN {s}.dag_run AS live"
            " ON live.dag_id = ti.dag_id AND live.run_id = ti.run_id WHERE ti.id = {t}.ti_id AND " + _LIVE + ")",
        )
    ],
    "dag": [
        (
            ("task_instance", "dag_version"),
            "NOT EXISTS (SELECT 1 FROM {s}.task_instance AS ti JOIN {s}.dag_version AS v ON v.id = ti.dag_version_id"
            " WHERE v.dag_id = {t}.dag_id)",
        )
    ],
    "trigger": [
        (("task_instance",), "NOT EXISTS (SELECT 1 FROM {s}.task_instance AS ti WHERE ti.trigger_id = {t}.id)"),
        (("asset_watcher",), "NOT EXISTS (SELECT 1 FROM {s}.asset_watcher AS aw WHERE aw.trigger_id = {t}.id)"),
        (("callback",), "NOT EXISTS (SELECT 1 FROM {s}.callback AS cb WHERE cb.trigger_id = {t}.id)"),
    ],
}
# Tables db clean knows that a deployment may not have: the Celery result backend's (only when it lives in
# the metadata database) and the archive an Airflow 2 -> 3 migration may have left. Left out unless named
# in ``tables``; db clean skips them where they are missing.
OPTIONAL_TABLES = ("_xcom_archive", "celery_taskmeta", "celery_tasksetmeta")
METADATA_DAG_ID = "retention_airflow_metadata"
SETTINGS_KEY = "airflow_metadata"
# db clean's alias of the table being cleaned (airflow.utils.db_cleanup._BASE_TABLE_ALIAS), and SQL's
# string literals, where it is left alone.
_BASE_ALIAS = re.compile(r"(?<![\w.\"])base\.")
_STRING_LITERAL = re.compile(r"('(?:[^']|'')*')")
_UNQUALIFIED_TABLE = re.compile(r"\b(FROM|JOIN)\s+([a-z_][a-z0-9_]*)\b(?![.(])")


@dataclass(frozen=True)
class MetadataSettings:
    """What a deployment decides about its metadata database; the rest comes from the installed Airflow.

    :param conn_id: an Airflow connection to the metadata database (a role of its own: docs).
    :param retention: how long rows are kept (``db clean --clean-before-timestamp`` = run date - this).
    :param schema: the schema of Airflow's tables (``[database] sql_alchemy_schema``, default ``public``).
    :param ledger_schema: the ledger's schema in the metadata database, apart from Airflow's tables.
    :param dag_retention: DAG id → retention for DAGs kept longer or shorter than ``retention``.
    :param tables: only these tables (default: every table ``db clean`` cleans but :data:`OPTIONAL_TABLES`).
    :param policy: more fields for every policy (``batch_size``, ``target_batch_time``, ``schedule`` ...).
    """

    conn_id: str
    retention: str = "90 days"
    schema: str = "public"
    ledger_schema: str = "airflow_retention"
    dag_retention: Mapping[str, str] = field(default_factory=dict)
    tables: tuple[str, ...] | None = None
    policy: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetadataSettings:
        known = {"conn_id", "retention", "schema", "ledger_schema", "dag_retention", "tables", "policy"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"airflow_metadata: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "conn_id" not in data:
            raise ValueError("airflow_metadata: field 'conn_id' is required (a connection to the metadata database)")
        tables = data.get("tables")
        return cls(
            conn_id=str(data["conn_id"]),
            retention=str(data.get("retention", cls.retention)),
            schema=str(data.get("schema", cls.schema)),
            ledger_schema=str(data.get("ledger_schema", cls.ledger_schema)),
            dag_retention={str(k): str(v) for k, v in (data.get("dag_retention") or {}).items()},
            tables=tuple(str(t) for t in tables) if tables else None,
            policy=dict(data.get("policy") or {}),
        )


# The name of the policy of a table's rows without a DAG id, after the table's own (per-DAG) policy's.
WITHOUT_DAG_SUFFIX = "_without_dag"


@dataclass(frozen=True)
class TableRule:
    """One table of ``db clean``'s configuration, as SQL."""

    table: str
    recency_column: str
    condition: str | None
    dag_id_column: str | None
    # Whether the installed Airflow's model lets the DAG id column be NULL (job, log): only then does a
    # per-DAG policy leave rows that need a policy of their own.
    dag_id_nullable: bool = False


def cleanup_order(configs: Mapping[str, Any]) -> list[str]:
    """The order ``db clean`` cleans its tables in: each table after its ``dependent_tables`` (depth first,
    as ``_effective_table_names`` collects them), so that, for example, a deadline is removed before the
    rule "a scheduled callback no deadline waits on" is decided. ``db clean`` starts from a Python set, so
    its order among unrelated tables varies from one run to the next; here it is by name, every time."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in configs:
            return
        seen.add(name)
        for dependent in sorted(configs[name].dependent_tables or []):
            visit(dependent)
        order.append(name)

    for name in sorted(configs):
        visit(name)
    return order


def cleanup_rules(schema: str = "public") -> list[TableRule]:
    """The installed Airflow's cleanup configuration, one rule per table in ``db clean``'s order."""
    from airflow.utils import db_cleanup
    from sqlalchemy import String
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.sql import visitors

    def plain(bind: Any) -> None:
        # Airflow's filters bind its str enums (DagRunType.MANUAL, CallbackState.FAILED) without a type:
        # rendered as the strings they are.
        values = bind.value if isinstance(bind.value, (list, tuple)) else [bind.value]
        values = [v.value if isinstance(v, enum.Enum) else v for v in values]
        if all(isinstance(v, str) for v in values):
            bind.type = String()
        bind.value = values if isinstance(bind.value, (list, tuple)) else values[0]

    def sql(expr: Any, alias: str) -> str:
        expr = visitors.cloned_traverse(expr, {}, {"bindparam": plain})
        text = str(expr.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        # Outside string literals only: db clean's correlated filters name the cleaned table by its alias
        # (literal_column("base.id")), renamed; a filter's subquery reads the metadata tables of this
        # schema, not the search path's (its lightweight table() carries no schema).
        # The split keeps the literals (a capturing group) at the odd places.
        parts = _STRING_LITERAL.split(text)
        for i in range(0, len(parts), 2):
            parts[i] = _UNQUALIFIED_TABLE.sub(rf"\1 {quote_ident(schema)}.\2", _BASE_ALIAS.sub(f"{alias}.", parts[i]))
        return "".join(parts)

    from airflow.models import import_all_models
    from airflow.models.base import Base

    import_all_models()
    models = Base.metadata.tables  # the installed Airflow's schema: which tables have the DAG id column
    rules = []
    for name in cleanup_order(db_cleanup.config_dict):
        config = db_cleanup.config_dict[name]
        t = quote_ident(name)
        s = quote_ident(schema)
        recency = quote_ident(config.recency_column_name)
        parts = [sql(f, t) for f in config.extra_filters or []]
        for referencing, column in config.skip_if_referenced or []:
            parts.append(
                f"NOT EXISTS (SELECT 1 FROM {s}.{quote_ident(referencing)} AS ref"
                f" WHERE ref.{quote_ident(column)} = {t}.{quote_ident(config.referenced_pk_column)})"
            )
        if config.keep_last:
            group = " AND ".join(
                f"latest.{quote_ident(g)} = {t}.{quote_ident(g)}" for g in config.keep_last_group_by or []
            )
            filters = " AND ".join(sql(f, t) for f in config.keep_last_filters or [])
            where = " AND ".join(p for p in (group, filters) if p)
            parts.append(
                f"{t}.{recency} IS DISTINCT FROM (SELECT max(latest.{recency}) FROM {s}.{t} AS latest"
                + (f" WHERE {where}" if where else "")
                + ")"
            )
        for needs, guard in GUARDS.get(name, []):
            if all(table in models for table in needs):
                parts.append(guard.format(t=t, s=s))
        rules.append(
            TableRule(
                table=name,
                recency_column=config.recency_column_name,
                condition=" AND ".join(f"({p})" for p in parts) or None,
                # db clean names a DAG id column for tables that have none (task_reschedule) or call it
                # otherwise (asset_event.source_dag_id): per-DAG retention only where the model has it.
                dag_id_column=config.dag_id_column_name
                if config.dag_id_column_name and name in models and config.dag_id_column_name in models[name].c
                else None,
                dag_id_nullable=bool(
                    config.dag_id_column_name
                    and name in models
                    and config.dag_id_column_name in models[name].c
                    and models[name].c[config.dag_id_column_name].nullable
                ),
            )
        )
    return rules


def metadata_policies(
    settings: MetadataSettings, existing: set[str] | None = None, *, dag_id: str = METADATA_DAG_ID
) -> list[RetentionPolicy]:
    """One policy per table, in ``db clean``'s order.

    :param dag_id: the DAG that runs them (the view's and the backfill hints' DAG).
    :param existing: the tables the metadata database has (``db clean`` skips the others); None: the
        tables of ``settings`` whether they exist or not (a missing one fails its plan, naming it).
    """
    rules = cleanup_rules(settings.schema)
    wanted = set(settings.tables) if settings.tables else {r.table for r in rules} - set(OPTIONAL_TABLES)
    if settings.tables:
        unknown = sorted(wanted - {r.table for r in rules})
        if unknown:
            raise ValueError(
                f"airflow_metadata: field 'tables': {', '.join(unknown)} not cleaned by this Airflow's db clean;"
                f" known: {', '.join(r.table for r in rules)}"
            )
    policies = []
    for rule in rules:
        if rule.table not in wanted or (existing is not None and rule.table not in existing):
            continue
        data: dict[str, Any] = {
            "chunk_by": "block",
            **settings.policy,
            "name": f"airflow_{rule.table.lstrip('_')}",
            "conn_id": settings.conn_id,
            "table": f"{quote_ident(settings.schema)}.{quote_ident(rule.table)}",
            "timestamp_column": rule.recency_column,
            "retention": settings.retention,
            "condition": rule.condition,
            "ledger_schema": settings.ledger_schema,
            "dag_id": dag_id,
        }
        if settings.dag_retention and rule.dag_id_column:
            data["tenant_column"] = rule.dag_id_column
            data["tenant_retention"] = dict(settings.dag_retention)
            policies.append(RetentionPolicy.from_dict(data))
            if not rule.dag_id_nullable:
                continue
            # A tenant policy never removes a row without a tenant: the rows without a DAG id (the
            # scheduler's and triggerer's job rows, CLI commands' log rows) get a policy of their own,
            # at the common retention, run right after it, as db clean removes them.
            without = f"{quote_ident(rule.table)}.{quote_ident(rule.dag_id_column)} IS NULL"
            policies.append(
                RetentionPolicy.from_dict(
                    {
                        **{k: v for k, v in data.items() if k not in ("tenant_column", "tenant_retention")},
                        "name": f"{data['name']}{WITHOUT_DAG_SUFFIX}",
                        "condition": f"({without})" + (f" AND {rule.condition}" if rule.condition else ""),
                    }
                )
            )
            continue
        policies.append(RetentionPolicy.from_dict(data))
    return policies


def load_settings(path: str | Path) -> MetadataSettings:
    """The ``airflow_metadata:`` mapping of a YAML file (``airflow-retention init --airflow-metadata``)."""
    import yaml

    return parse_settings(yaml.safe_load(Path(path).read_text()), str(path))


def parse_settings(doc: Any, where: str) -> MetadataSettings:
    """The settings of a YAML document read already (``where``: its file, for the error)."""
    if not isinstance(doc, dict) or not isinstance(doc.get(SETTINGS_KEY), dict):
        raise ValueError(f"{where}: no '{SETTINGS_KEY}:' mapping (docs/airflow-metadata.md)")
    return MetadataSettings.from_dict(doc[SETTINGS_KEY])


def build_metadata_dag(settings: MetadataSettings, *, dag_id: str = METADATA_DAG_ID, **group_kwargs: Any) -> Any:
    """One DAG for the metadata database: each table's plan → chunks → verify, one table after another in
    ``db clean``'s order (a DAG's latest version is decided after its runs are purged, as there), each
    table's plan starting whatever became of the one before, and a last task, ``every_table_purged``,
    that fails the run when any table failed; on the schedule of the policies (``policy: {schedule:
    ...}``, default daily), ``max_active_runs=1``."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG, chain

    from airflow_retention.dag_factory import retention_task_group, task_defaults

    policies = metadata_policies(settings, dag_id=dag_id)
    first = policies[0]
    with DAG(
        dag_id=dag_id,
        schedule=first.schedule,
        start_date=first.start_date,
        catchup=first.catchup,
        max_active_runs=1,
        default_args=task_defaults(first),
        tags=["retention", "airflow-metadata"],
        description=f"Delete rows of Airflow's metadata database older than {settings.retention}, as airflow db clean",
        doc_md="\n\n".join(p.describe() for p in policies),
    ) as dag:
        groups = [retention_task_group(p, group_id=p.name, **group_kwargs) for p in policies]
        for group in groups[1:]:
            # One table after another, whatever became of the one before: a table that fails (a grant
            # missing) does not keep the others from being purged.
            group.children[f"{group.group_id}.plan"].trigger_rule = "all_done"
        chain(*groups)
        # ... and the run fails when any table did: the run's state is its leaves'.
        groups >> EmptyOperator(task_id="every_table_purged", trigger_rule="all_success")
    return dag


def metadata_dag_from_yaml(path: str | Path) -> dict[str, Any]:
    """The metadata DAG of a settings file, keyed by id for a DAG file's ``globals().update(...)``; a bad
    file becomes a DAG of the same id that fails at once with the error (never an import error)."""
    from airflow_retention.dag_factory import invalid_policy_dag

    try:
        dag = build_metadata_dag(load_settings(path))
        dag.validate()
    except Exception as exc:  # noqa: BLE001 - shown as the DAG's error, the file stays importable
        log.warning("invalid Airflow metadata retention settings: %s", exc)
        return {METADATA_DAG_ID: invalid_policy_dag(METADATA_DAG_ID, [f"{path}: {exc}"])}
    return {dag.dag_id: dag}
