"""``RetentionPolicy``: the validated, immutable description of one retention rule, built from Python or
from its YAML mapping, and what follows from a policy alone (its description, its DAG id).

Its fields are checked by :mod:`.validation`; its throttle is a :class:`~.throttle.Throttle` (importable
from here too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.budget import Budget
from airflow_retention.core.policy.durations import Retention, format_window
from airflow_retention.core.policy.identifiers import TableName, display_name
from airflow_retention.core.policy.keys import RENAMED_KEYS, REQUIRED_KEYS, unknown_key_hint
from airflow_retention.core.policy.throttle import Throttle
from airflow_retention.core.policy.validation import validated_fields

# A chunk task costs about 0.6 s of scheduling and process start under LocalExecutor (docs/performance.md):
# 45 s chunks keep that near 1 %, and still give a retry or a worker restart little to redo.
DEFAULT_TARGET_CHUNK_MS = 45_000
DEFAULT_START_DATE = datetime(2025, 1, 1, tzinfo=timezone.utc)
# The DAG of policy ``p`` built by the DAG factory is ``retention_<p>``.
DAG_ID_PREFIX = "retention_"


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """One retention rule: which rows of which table expire, and how to delete them.

    :param name: the policy's identity, a slug (``[a-z][a-z0-9_]*``); used in run keys and DAG ids.
    :param conn_id: the Airflow Postgres connection of the target database.
    :param table: the target table, optionally schema-qualified (``schema.table``); taken literally, or
        written SQL-quoted when a name holds a dot or a quote (``'"Tenant Data"."order"'``). A plain
        or a declaratively partitioned table.
    :param timestamp_column: the timestamptz (or timestamp, read as UTC) column compared with the cutoff.
    :param retention: how long rows are kept: ``"90 days"``, ``"P90D"``, ``"1 year"`` or a timedelta.
    :param key_column: with ``chunk_by: key`` (required there), a unique, indexed integer or bigint
        column: chunks and batches are ranges of it. With ``chunk_by: block`` optional and of any type.
    :param condition: extra eligibility, trusted SQL written by the DAG author, re-checked by every
        DELETE and wrapped in parentheses. Never build it from user input.
    :param tenant_column: the column that says whose a row is. With block chunks every batch deletes the
        eligible rows of all tenants in its blocks in one pass and records rows deleted per tenant
        (``tenant_counts`` in the ledger); with key chunks, chunks are planned per tenant.
    :param tenant_retention: tenant value → retention, overriding ``retention`` for those tenants
        (``{"acme": "365 days"}``); a mapping in YAML and Python. Frozen per run by the planner.
    :param tenant_retention_table: a table in the target database with a column named like
        ``tenant_column`` and an ``interval`` column ``retention``, read at planning: more overrides
        (``tenant_retention`` wins where both name a tenant).
    :param max_rows_per_tenant: per run, stop deleting a tenant's rows once this many were deleted;
        its remaining rows are deferred to the next run (cleanup lag), not a failure.
    :param chunk_by: ``"block"`` (the default): chunks and batches are ranges of the table's physical
        blocks (``ctid``, per leaf partition of a partitioned table), read in order like a sequential
        scan; no key needed, no counting scan at planning (a sample estimates the eligible rows); with a
        tenant column, every tenant in one pass, counted per tenant; needs PostgreSQL 14+. ``"key"``:
        ranges of ``key_column``, per tenant with a tenant column, counted exactly at planning.
    :param expired_partitions: what becomes of a leaf partition of a partitioned table whose whole
        range of ``timestamp_column`` is before the cutoff: ``"delete"`` (default: its rows are deleted
        in batches like any other), ``"detach"`` (``DETACH PARTITION … CONCURRENTLY``, the table is
        kept) or ``"drop"`` (detached, then dropped). With a ``condition`` a partition is detached or
        dropped only when a check under lock proves every row of it eligible.
    :param detached_schema: with ``expired_partitions: detach``, move each detached partition into
        this (existing) schema.
    :param batch_size: keys per batch transaction (every row of the batch's key range, eligible or not),
        and the first batch's size when batches adapt; 1 to 1,000,000.
    :param target_batch_ms: (YAML ``target_batch_time``) adapt the batch size so that a batch transaction
        takes about this long (``"200ms"``); 0 keeps every batch at ``batch_size``.
    :param min_batch_size: the smallest adapted batch (default 500, or ``batch_size`` if smaller).
    :param max_batch_size: the largest adapted batch (default 500,000, or ``batch_size`` if larger); the
        target time, not this cap, normally sets the size.
    :param chunk_rows: eligible rows per chunk (one mapped task), at least ``batch_size``; an explicit
        override of ``target_chunk_ms``. None (the default): chunks are sized by time.
    :param target_chunk_ms: (YAML ``target_chunk_time``) with ``chunk_rows`` unset, the planner picks the
        chunk count so that a chunk takes about this long (``"45s"``, at least 1 s), from the policy's
        measured rate in its previous runs, else a conservative estimate.
    :param max_duty_cycle: the share of wall time a chunk may spend inside batch transactions, above 0
        and at most 1: after a batch of ``t`` seconds the engine pauses ``t * (1 / max_duty_cycle - 1)``.
        1 (the default) never pauses; 0.5 takes twice as long and leaves the database idle half the time
        (it spreads the purge's WAL and checkpoint writes; ``wal_compression`` is what shortens the
        foreground's latency tail).
    :param wal_compression: ``wal_compression`` in every batch transaction: how the batches write the
        full-page images that make most of a purge's WAL (the first change to each page after a checkpoint
        writes the whole 8 kB page). ``"server"`` (the default) leaves the server's setting; ``"lz4"``,
        ``"zstd"``, ``"pglz"`` or ``"off"`` set it (``SET LOCAL``), and the plan fails at once when this
        role may not (superuser, or ``GRANT SET ON PARAMETER wal_compression``, PostgreSQL 15+) or the
        server lacks the method; ``"auto"`` sets lz4 when it can and otherwise leaves the server's setting
        (logged). Compressed images cost CPU in the purging session and cut its WAL to 0.34-0.74x of
        uncompressed, depending on how the rows compress, and with it the foreground's commit latency
        during the purge (docs/performance.md).
    :param synchronous_commit: ``synchronous_commit`` of the batch transactions. ``"off"`` (the default):
        a batch's commit does not wait for its WAL to reach disk (or a synchronous standby); a server
        crash can undo the last batches committed before it (about 3 x ``wal_writer_delay``), each
        together with its ledger row, so the retry deletes those rows again. With ``"off"`` the
        transaction that completes a chunk commits with the server's setting, so that a chunk reported
        done is durable.
        ``"server"`` leaves the server's setting for every batch; ``"on"``, ``"local"``,
        ``"remote_write"``, ``"remote_apply"`` set that value (any role may).
    :param lock_timeout_ms: (YAML ``lock_timeout``) ``lock_timeout`` set in every batch transaction
        (``"5s"``, ms as int).
    :param statement_timeout_ms: (YAML ``statement_timeout``) ``statement_timeout`` set in every batch transaction.
    :param dry_run: count what would be deleted and delete nothing.
    :param archive_table: move deleted rows into this table in the same transaction (same column names).
    :param ledger_schema: the schema of the ledger tables in the target database.
    :param schedule: the DAG's schedule.
    :param start_date: the DAG's start date.
    :param catchup: whether the scheduler creates runs for missed intervals.
    :param throttle: pressure checks between batches (``Throttle``; a mapping in YAML).
    :param budget: how much of the database the purge may use, steered by a controller with
        hysteresis from pressure signals read between batches (:class:`~.budget.Budget`; a mapping in
        YAML, ``false`` to turn it off). On by default.
    :param vacuum_after_rows: run ``VACUUM (ANALYZE)`` on the table after a run that deleted at least
        this many rows. None: never.
    :param ledger_keep_days: the planner deletes this policy's ledger runs planned (or completed) more
        than this many days ago; at least 35, so the missed-run report of the last 31 days stays whole.
    :param queue: the Airflow queue of every task of the policy (a Celery queue, say).
    :param pool: Airflow pool the chunk tasks run in (the database budget).
    :param max_active_chunks: chunk tasks of one run running at once.
    :param retries: retries of every task (exponential backoff).
    :param retry_delay_ms: (YAML ``retry_delay``) the first retry's delay (``"30s"``); it doubles up to 10 minutes.
    :param tags: extra DAG tags.
    :param description: free text shown in the DAG's documentation.
    :param dag_id: the DAG that runs the policy, when it is not ``retention_<name>`` (the policies of
        Airflow's metadata database all run in ``retention_airflow_metadata``): the view, the command's
        backfill hints and the DAG factory use it.
    :param cleanup_window: how long after its date (the DAG run's logical date) a run must be complete
        (``"24h"``, ``"2 days"``, a timedelta; 1 minute to 366 days, no months). On Airflow 3.1+ the DAG
        factory makes it a deadline alert whose callback says that the run is late. None: no deadline.
    :param asset: the policy's table as an Airflow asset, updated by every run that completes:
        ``True`` names it ``postgres://host:port/database/schema/table`` from the connection when the DAG
        is parsed; a URI of that form names it without the connection. None (or False): no asset.
    """

    name: str
    conn_id: str
    table: TableName
    timestamp_column: str
    retention: Retention
    key_column: str | None = None
    condition: str | None = None
    tenant_column: str | None = None
    tenant_retention: tuple[tuple[str, Retention], ...] = ()
    tenant_retention_table: TableName | None = None
    max_rows_per_tenant: int | None = None
    chunk_by: str | None = None
    expired_partitions: str = "delete"
    detached_schema: str | None = None
    batch_size: int = 5000
    target_batch_ms: int = 200
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    chunk_rows: int | None = None
    target_chunk_ms: int = DEFAULT_TARGET_CHUNK_MS
    max_duty_cycle: float = 1.0
    wal_compression: str = "server"
    synchronous_commit: str = "off"
    lock_timeout_ms: int = 5_000
    statement_timeout_ms: int = 60_000
    dry_run: bool = False
    archive_table: TableName | None = None
    ledger_schema: str = "retention"
    schedule: str | None = "@daily"
    start_date: datetime = DEFAULT_START_DATE
    catchup: bool = False
    throttle: Throttle = field(default_factory=Throttle)
    budget: Budget = field(default_factory=Budget)
    vacuum_after_rows: int | None = None
    ledger_keep_days: int = 180
    queue: str | None = None
    pool: str | None = None
    max_active_chunks: int = 4
    retries: int = 3
    retry_delay_ms: int = 30_000
    tags: tuple[str, ...] = field(default_factory=tuple)
    description: str | None = None
    dag_id: str | None = None
    cleanup_window: timedelta | None = None
    asset: bool | str | None = None

    def __post_init__(self) -> None:
        # Normalise and validate in place so that every way of building a policy ends up checked.
        for name, value in validated_fields(self).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None) -> RetentionPolicy:
        """Build a policy from a mapping as written in YAML (``lock_timeout``, ``statement_timeout``)."""
        merged = {**(defaults or {}), **data}
        name = merged.get("name")
        label = name if isinstance(name, str) else None
        unknown = sorted((set(merged) - _YAML_KEYS), key=str)
        if unknown:
            raise PolicyError(label, unknown[0], f"unknown key{unknown_key_hint(unknown[0], _YAML_KEYS)}")
        missing = [k for k in REQUIRED_KEYS if k not in merged]
        if missing:
            raise PolicyError(label, missing[0], "is required")
        kwargs = dict(merged)
        for yaml_key, attr in RENAMED_KEYS.items():
            if yaml_key in kwargs:
                kwargs[attr] = kwargs.pop(yaml_key)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a wrong type that slipped past a field check
            raise PolicyError(label, None, str(exc)) from exc

    def describe(self) -> str:
        """A Markdown description of the policy and its cutoff rule, for ``doc_md`` and logs."""
        rows = [
            ("table", f"`{self.table}`"),
            ("key column", f"`{display_name(self.key_column)}`" if self.key_column else "none"),
            ("timestamp column", f"`{display_name(self.timestamp_column)}`"),
            ("retention", str(self.retention)),
            ("condition", f"`{self.condition}`" if self.condition else "none"),
            ("tenant column", f"`{display_name(self.tenant_column)}`" if self.tenant_column else "none"),
            (
                "per-tenant retention",
                ", ".join(f"`{t}`: {r}" for t, r in self.tenant_retention)
                + (f" and table `{self.tenant_retention_table}`" if self.tenant_retention_table else "")
                if self.tenant_retention or self.tenant_retention_table
                else "none",
            ),
            ("rows per tenant per run", f"{self.max_rows_per_tenant:,}" if self.max_rows_per_tenant else "no cap"),
            ("chunks by", "key ranges" if self.chunk_by == "key" else "block ranges (physical order)"),
            (
                "whole expired partitions",
                self.expired_partitions
                + (f" into schema `{display_name(self.detached_schema)}`" if self.detached_schema else ""),
            ),
            (
                "batch size / chunk rows",
                f"{self.batch_size:,} / "
                + (f"{self.chunk_rows:,}" if self.chunk_rows else f"sized to about {self.target_chunk_ms / 1000:g} s"),
            ),
            ("duty cycle", f"at most {self.max_duty_cycle:.0%} of the time in batches"),
            (
                "database budget",
                f"on: up to {self.budget.max_workers} batch(es) at once on the database"
                + (f" ({self.budget.tenant_ceiling} per tenant)" if self.tenant_column else "")
                + ", steered every"
                f" {self.budget.period_ms / 1000:g} s by the foreground's latency"
                if self.budget.enabled
                else "off",
            ),
            ("WAL compression in batches", self.wal_compression),
            ("synchronous_commit in batches", self.synchronous_commit),
            (
                "adaptive batches",
                f"{self.min_batch_size:,}–{self.max_batch_size:,} rows, aiming at {self.target_batch_ms} ms"
                if self.target_batch_ms
                else "off",
            ),
            ("lock / statement timeout", f"{self.lock_timeout_ms} ms / {self.statement_timeout_ms} ms"),
            ("archive table", f"`{self.archive_table}`" if self.archive_table else "none"),
            ("dry run", "yes" if self.dry_run else "no"),
            ("connection", f"`{self.conn_id}`"),
            ("ledger", f"schema `{self.ledger_schema}` in the target database"),
        ]
        if self.cleanup_window is not None:
            rows.append(("cleanup window", f"complete {format_window(self.cleanup_window)} after the run's date"))
        if self.asset is not None:
            uri = "`postgres://host:port/database/schema/table` of the connection" if self.asset is True else None
            rows.append(("asset", uri or f"`{self.asset}`"))
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return (
            f"### Retention policy `{self.name}`\n\n"
            + (f"{self.description}\n\n" if self.description else "")
            + "| setting | value |\n|---|---|\n"
            + table
            + "\n\n**Cutoff rule.** Each run freezes one cutoff: the run's data interval end (else its logical"
            f" date, else its `run_after`) minus {self.retention}, in UTC. A row is deleted when"
            f" `{display_name(self.timestamp_column)}` < cutoff"
            + (" and the condition holds" if self.condition else "")
            + " at the moment of the DELETE. Runs of the same date share the cutoff and the ledger entry,"
            " so re-running or backfilling a date is harmless.\n"
        )


_YAML_KEYS = ({f.name for f in dataclasses.fields(RetentionPolicy)} - set(RENAMED_KEYS.values())) | set(RENAMED_KEYS)


def has_per_tenant_rules(policy: RetentionPolicy) -> bool:
    """Whether the policy's statements test each row against its tenant's own cutoff and the cap."""
    return policy.tenant_column is not None and bool(
        policy.tenant_retention or policy.tenant_retention_table is not None or policy.max_rows_per_tenant
    )


def policy_dag_id(policy: RetentionPolicy) -> str:
    """The id of the DAG that runs ``policy``: its ``dag_id``, else ``retention_<name>``."""
    return policy.dag_id or f"{DAG_ID_PREFIX}{policy.name}"
