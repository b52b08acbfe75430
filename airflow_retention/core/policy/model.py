"""``RetentionPolicy``: the validated, immutable description of one retention rule."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.durations import Retention, parse_timeout_ms
from airflow_retention.core.policy.identifiers import TableName, check_ident, display_name

MIN_BATCH_SIZE = 1
MAX_BATCH_SIZE = 1_000_000
DEFAULT_MIN_BATCH_SIZE = 500
DEFAULT_MAX_BATCH_SIZE = 500_000
MAX_CHUNK_ROWS = 100_000_000
# A chunk task costs about 0.6 s of scheduling and process start under LocalExecutor (docs/performance.md):
# 45 s chunks keep that near 1 %, and still give a retry or a worker restart little to redo.
DEFAULT_TARGET_CHUNK_MS = 45_000
MIN_TARGET_CHUNK_MS = 1_000
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_DAG_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")
DEFAULT_START_DATE = datetime(2025, 1, 1, tzinfo=timezone.utc)
# The DAG of policy ``p`` built by the DAG factory is ``retention_<p>``.
DAG_ID_PREFIX = "retention_"
CHUNK_BY = ("key", "block")
# What happens to a partition whose whole range is expired (docs/policies.md).
EXPIRED_PARTITIONS = ("delete", "detach", "drop")
# "server": the server's own; "auto": lz4 when the role may set it; else the value set in every batch.
WAL_COMPRESSION = ("server", "auto", "lz4", "zstd", "pglz", "off")
SYNCHRONOUS_COMMIT = ("off", "server", "local", "remote_write", "on", "remote_apply")


@dataclass(frozen=True)
class Throttle:
    """When the engine pauses between batches, so that a purge yields to a busy database.

    Every check runs between two batches, outside their transactions. While any signal is above its
    threshold the engine sleeps (``backoff``, doubling with jitter up to a minute) and checks again; once
    it has paused ``give_up_after`` in one attempt it stops the chunk as retryable: its committed batches
    stay, and Airflow's retry resumes it later.

    :param max_replica_lag_ms: (YAML ``max_replica_lag``) the largest replay lag of any standby
        (``pg_stat_replication.replay_lag`` on the primary) before pausing; ``"30s"`` or ms as int.
        None: not checked. The role needs ``pg_monitor`` to see the lag.
    :param max_lock_waiters: lock requests waiting on the target table (``pg_locks``, not granted) before
        pausing, e.g. a migration's ``ALTER TABLE`` queued behind the purge. None: not checked.
    :param probe: trusted SQL of the DAG author that returns one number (say, active sessions); it is
        compared with ``probe_max``.
    :param probe_max: the probe's largest acceptable value.
    :param backoff_ms: (YAML ``backoff``) the first pause.
    :param give_up_after_ms: (YAML ``give_up_after``) total pause of one attempt after which the chunk
        stops as retryable.
    """

    max_replica_lag_ms: int | None = None
    max_lock_waiters: int | None = None
    probe: str | None = None
    probe_max: float | None = None
    backoff_ms: int = 1_000
    give_up_after_ms: int = 600_000

    def __post_init__(self) -> None:
        for name, value in _validated_throttle(self).items():
            object.__setattr__(self, name, value)

    @property
    def enabled(self) -> bool:
        return self.max_replica_lag_ms is not None or self.max_lock_waiters is not None or self.probe is not None

    @classmethod
    def from_value(cls, value: object) -> Throttle:
        """A ``Throttle`` from its YAML mapping (``max_replica_lag``, ``backoff``, ...)."""
        if value is None:
            return cls()
        if isinstance(value, Throttle):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping of throttle settings, got {value!r}")
        unknown = sorted(set(value) - set(_THROTTLE_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}{unknown_key_hint(unknown[0], _THROTTLE_KEYS)}")
        return cls(**{_THROTTLE_KEYS[k]: v for k, v in value.items()})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, attr) for k, attr in _THROTTLE_KEYS.items()}


def unknown_key_hint(key: object, known: Iterable[str]) -> str:
    """The end of an unknown-key message: the known key closest to a typo (``: did you mean
    'condition'?``), or, when none is close, every known key (a list of 40 hides the one meant)."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    if close:
        return f": did you mean {close[0]!r}?"
    return f" (known keys: {', '.join(sorted(known))})"


_THROTTLE_KEYS = {
    "max_replica_lag": "max_replica_lag_ms",
    "max_lock_waiters": "max_lock_waiters",
    "probe": "probe",
    "probe_max": "probe_max",
    "backoff": "backoff_ms",
    "give_up_after": "give_up_after_ms",
}


def _validated_throttle(t: Throttle) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if t.max_replica_lag_ms is not None:
        out["max_replica_lag_ms"] = _throttle_field("max_replica_lag", parse_timeout_ms, t.max_replica_lag_ms)
    if t.max_lock_waiters is not None:
        if isinstance(t.max_lock_waiters, bool) or not isinstance(t.max_lock_waiters, int) or t.max_lock_waiters < 0:
            raise ValueError(f"max_lock_waiters: must be a non-negative integer, got {t.max_lock_waiters!r}")
    if (t.probe is None) != (t.probe_max is None):
        raise ValueError("probe and probe_max go together: give both or neither")
    if t.probe is not None:
        out["probe"] = _throttle_field("probe", check_probe, t.probe)
        if isinstance(t.probe_max, bool) or not isinstance(t.probe_max, (int, float)):
            raise ValueError(f"probe_max: must be a number, got {t.probe_max!r}")
        out["probe_max"] = float(t.probe_max)
    out["backoff_ms"] = _throttle_field("backoff", parse_timeout_ms, t.backoff_ms)
    out["give_up_after_ms"] = _throttle_field("give_up_after", parse_timeout_ms, t.give_up_after_ms)
    return out


def _throttle_field(name: str, fn: Any, value: Any) -> Any:
    try:
        return fn(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def check_probe(probe: object) -> str:
    """A throttle probe is one trusted query of the DAG author, run as written between batches."""
    if not isinstance(probe, str) or not probe.strip():
        raise ValueError("must be a non-empty SQL query returning one number")
    if ";" in probe.strip().rstrip(";"):
        raise ValueError("must be one query: ';' is not allowed")
    return probe.strip().rstrip(";")


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

    def __post_init__(self) -> None:
        # Normalise and validate in place so that every way of building a policy ends up checked.
        for name, value in _validated(self).items():
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
        missing = [k for k in _REQUIRED if k not in merged]
        if missing:
            raise PolicyError(label, missing[0], "is required")
        kwargs = dict(merged)
        for yaml_key, attr in _RENAMED.items():
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


_REQUIRED = ("name", "conn_id", "table", "timestamp_column", "retention")
_RENAMED = {
    "lock_timeout": "lock_timeout_ms",
    "statement_timeout": "statement_timeout_ms",
    "retry_delay": "retry_delay_ms",
    "target_batch_time": "target_batch_ms",
    "target_chunk_time": "target_chunk_ms",
}
_YAML_KEYS = ({f.name for f in dataclasses.fields(RetentionPolicy)} - set(_RENAMED.values())) | set(_RENAMED)


def _validated(policy: RetentionPolicy) -> dict[str, Any]:
    """Check every field; return the normalised values. Raises ``PolicyError`` on the first problem."""
    name = policy.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise PolicyError(
            name if isinstance(name, str) else None,
            "name",
            f"{name!r} is not a slug (lower-case letters, digits and _, starting with a letter, at most 63)",
        )

    def fail(field_name: str, problem: str) -> PolicyError:
        return PolicyError(name, field_name, problem)

    out: dict[str, Any] = {}
    if policy.dag_id is not None and (not isinstance(policy.dag_id, str) or not _DAG_ID.match(policy.dag_id)):
        raise fail("dag_id", f"{policy.dag_id!r} is not a DAG id (letters, digits, '_', '-' and '.', at most 250)")

    def convert(field_name: str, fn: Any, value: Any) -> Any:
        try:
            return fn(value)
        except ValueError as exc:
            raise fail(field_name, str(exc)) from None

    if not isinstance(policy.conn_id, str) or not policy.conn_id.strip():
        raise fail("conn_id", "must be a non-empty connection id")
    out["table"] = convert("table", TableName.parse, policy.table)
    out["timestamp_column"] = convert("timestamp_column", check_ident, policy.timestamp_column)
    for col in ("key_column", "tenant_column"):
        if getattr(policy, col) is not None:
            out[col] = convert(col, check_ident, getattr(policy, col))
    if out.get("key_column") == out["timestamp_column"]:
        raise fail("timestamp_column", "must be another column than key_column")
    if "tenant_column" in out and out["tenant_column"] in (out.get("key_column"), out["timestamp_column"]):
        raise fail("tenant_column", "must be another column than key_column and timestamp_column")
    # Block chunks are the faster default, with or without tenants (one pass; docs/performance.md).
    chunk_by = policy.chunk_by if policy.chunk_by is not None else "block"
    if chunk_by not in CHUNK_BY:
        raise fail("chunk_by", f"must be 'key' or 'block', got {policy.chunk_by!r}")
    out["chunk_by"] = chunk_by
    if chunk_by == "key" and out.get("key_column") is None:
        raise fail(
            "key_column",
            "is required with chunk_by 'key' (a unique integer column); chunk_by 'block' needs no key",
        )
    out["tenant_retention"] = convert("tenant_retention", _tenant_map, policy.tenant_retention or ())
    if policy.tenant_retention_table is not None:
        out["tenant_retention_table"] = convert(
            "tenant_retention_table", TableName.parse, policy.tenant_retention_table
        )
    if policy.max_rows_per_tenant is not None:
        out["max_rows_per_tenant"] = _int_in_range(fail, "max_rows_per_tenant", policy.max_rows_per_tenant, 1, 2**62)
    for per_tenant in ("tenant_retention", "tenant_retention_table", "max_rows_per_tenant"):
        if out.get(per_tenant) and "tenant_column" not in out:
            raise fail(per_tenant, "needs tenant_column: it says whose each row is")
    if policy.expired_partitions not in EXPIRED_PARTITIONS:
        raise fail("expired_partitions", f"must be 'delete', 'detach' or 'drop', got {policy.expired_partitions!r}")
    if policy.detached_schema is not None:
        if policy.expired_partitions != "detach":
            raise fail(
                "detached_schema",
                f"only applies with expired_partitions 'detach' (this policy has {policy.expired_partitions!r})",
            )
        out["detached_schema"] = convert("detached_schema", check_ident, policy.detached_schema)
    out["retention"] = convert("retention", Retention.parse, policy.retention)
    if policy.condition is not None:
        out["condition"] = convert("condition", check_condition, policy.condition)
    out["batch_size"] = _int_in_range(fail, "batch_size", policy.batch_size, MIN_BATCH_SIZE, MAX_BATCH_SIZE)
    out["target_batch_ms"] = convert("target_batch_time", _ms_or_off, policy.target_batch_ms)
    smallest = policy.min_batch_size
    if smallest is None:
        smallest = min(DEFAULT_MIN_BATCH_SIZE, out["batch_size"])
    out["min_batch_size"] = _int_in_range(fail, "min_batch_size", smallest, MIN_BATCH_SIZE, out["batch_size"])
    largest = policy.max_batch_size
    if largest is None:
        largest = max(DEFAULT_MAX_BATCH_SIZE, out["batch_size"])
    out["max_batch_size"] = _int_in_range(fail, "max_batch_size", largest, out["batch_size"], MAX_BATCH_SIZE)
    if policy.chunk_rows is not None:
        out["chunk_rows"] = _int_in_range(fail, "chunk_rows", policy.chunk_rows, 1, MAX_CHUNK_ROWS)
        if out["chunk_rows"] < out["batch_size"]:
            raise fail("chunk_rows", f"must be at least batch_size ({out['batch_size']}), got {out['chunk_rows']}")
    out["target_chunk_ms"] = convert("target_chunk_time", parse_timeout_ms, policy.target_chunk_ms)
    if out["target_chunk_ms"] < MIN_TARGET_CHUNK_MS:
        raise fail("target_chunk_time", f"must be at least 1s, got {policy.target_chunk_ms!r}")
    out["max_duty_cycle"] = _duty_cycle(fail, policy.max_duty_cycle)
    out["wal_compression"] = _setting(fail, "wal_compression", policy.wal_compression, WAL_COMPRESSION)
    out["synchronous_commit"] = _setting(fail, "synchronous_commit", policy.synchronous_commit, SYNCHRONOUS_COMMIT)
    out["lock_timeout_ms"] = convert("lock_timeout", parse_timeout_ms, policy.lock_timeout_ms)
    out["statement_timeout_ms"] = convert("statement_timeout", parse_timeout_ms, policy.statement_timeout_ms)
    if not isinstance(policy.dry_run, bool):
        raise fail("dry_run", f"must be true or false, got {policy.dry_run!r}")
    if policy.archive_table is not None:
        out["archive_table"] = convert("archive_table", TableName.parse, policy.archive_table)
        if out["archive_table"] == out["table"]:
            raise fail("archive_table", "must differ from table")
        if policy.expired_partitions == "drop":
            raise fail(
                "expired_partitions",
                "'drop' would drop rows that archive_table should receive: use 'detach' (the detached"
                " partition is the archive of its rows) or 'delete' (rows move to archive_table)",
            )
    out["ledger_schema"] = convert("ledger_schema", check_ident, policy.ledger_schema)
    if policy.schedule is not None and (not isinstance(policy.schedule, str) or not policy.schedule.strip()):
        raise fail("schedule", f"must be a cron expression or preset such as '@daily', got {policy.schedule!r}")
    out["start_date"] = convert("start_date", _aware_datetime, policy.start_date)
    if not isinstance(policy.catchup, bool):
        raise fail("catchup", f"must be true or false, got {policy.catchup!r}")
    out["throttle"] = convert("throttle", Throttle.from_value, policy.throttle)
    if policy.vacuum_after_rows is not None:
        out["vacuum_after_rows"] = _int_in_range(fail, "vacuum_after_rows", policy.vacuum_after_rows, 1, 2**62)
    out["ledger_keep_days"] = _int_in_range(fail, "ledger_keep_days", policy.ledger_keep_days, 35, 36_500)
    for name_ in ("queue", "pool"):
        value = getattr(policy, name_)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise fail(name_, f"must be a {name_} name")
    out["max_active_chunks"] = _int_in_range(fail, "max_active_chunks", policy.max_active_chunks, 1, 1024)
    out["retries"] = _int_in_range(fail, "retries", policy.retries, 0, 100)
    out["retry_delay_ms"] = convert("retry_delay", parse_timeout_ms, policy.retry_delay_ms)
    tags = policy.tags
    if isinstance(tags, str) or not isinstance(tags, Iterable) or not all(isinstance(t, str) for t in tags):
        raise fail("tags", "must be a list of strings")
    out["tags"] = tuple(tags)
    return out


def _tenant_map(value: object) -> tuple[tuple[str, Retention], ...]:
    """``{tenant: duration}`` as sorted pairs; tenants travel as text (``7`` and ``"7"`` are one tenant)."""
    if isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a mapping of tenant value to retention, got {type(value).__name__}")
    pairs: dict[str, Retention] = {}
    for tenant, duration in value.items():
        if tenant is None or isinstance(tenant, (bool, float, list, dict)):
            raise ValueError(f"tenant {tenant!r}: a tenant value must be text or an integer")
        try:
            pairs[str(tenant)] = Retention.parse(duration)
        except ValueError as exc:
            raise ValueError(f"tenant {tenant!r}: {exc}") from None
    return tuple(sorted(pairs.items()))


def _ms_or_off(value: object) -> int:
    """A duration in ms, where 0 (or ``"0"``, ``"off"``) switches the feature off."""
    if value in (0, "0", "off"):
        return 0
    return parse_timeout_ms(value)


def _setting(fail: Any, name: str, value: object, allowed: tuple[str, ...]) -> str:
    """A server setting's value among ``allowed``; YAML reads a bare ``off`` as false and ``on`` as true."""
    if isinstance(value, bool):
        value = "on" if value else "off"
    chosen = value.lower() if isinstance(value, str) else value
    if chosen not in allowed:
        raise fail(name, f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(chosen)


def _duty_cycle(fail: Any, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail("max_duty_cycle", f"must be a number above 0 and at most 1, got {value!r}")
    if not 0 < value <= 1:
        raise fail("max_duty_cycle", f"must be above 0 and at most 1 (a share of wall time), got {value!r}")
    return float(value)


def _int_in_range(fail: Any, field_name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(field_name, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise fail(field_name, f"must be between {lo:,} and {hi:,}, got {value:,}")
    return value


def _aware_datetime(value: object) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an ISO date") from None
    if isinstance(value, date) and not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    if not isinstance(value, datetime):
        raise ValueError(f"must be a date, got {type(value).__name__}")
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def check_condition(condition: object) -> str:
    """Check that a condition cannot escape the parentheses it is wrapped in.

    The condition is trusted SQL, but a stray ``)``, ``;`` or comment would silently change the rest of
    the predicate (``true) or (true`` would make every row eligible); those are refused here. So is
    every quoting form whose end this scanner could misjudge: backslashes (``E'\\''`` strings, or any
    string when ``standard_conforming_strings`` is off) and ``$`` (dollar quoting). The database checks
    the rest when the policy is first used.
    """
    if not isinstance(condition, str) or not condition.strip():
        raise ValueError("must be a non-empty SQL boolean expression")
    if "\\" in condition:
        raise ValueError("backslashes are not allowed (write E'' strings another way)")
    if "$" in condition:
        raise ValueError("'$' is not allowed (no dollar quoting or parameters)")
    depth = 0
    i, n = 0, len(condition)
    while i < n:
        ch = condition[i]
        if ch in ("'", '"'):
            end = condition.find(ch, i + 1)
            while end != -1 and end + 1 < n and condition[end + 1] == ch:  # doubled quote inside
                end = condition.find(ch, end + 2)
            if end == -1:
                raise ValueError(f"unterminated {ch} quote")
            i = end + 1
            continue
        if ch == ";":
            raise ValueError("must be one expression: ';' is not allowed")
        if condition.startswith("--", i) or condition.startswith("/*", i):
            raise ValueError("comments are not allowed")
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError("has a ')' without a matching '('")
        i += 1
    if depth:
        raise ValueError("has an unclosed '('")
    return condition.strip()


def load_policies(path: str | Path) -> list[RetentionPolicy]:
    """Load every policy of a YAML file; raise on the first bad one."""
    policies, errors = load_policies_lenient(path)
    if errors:
        raise errors[0]
    return policies


INVALID_POLICIES_DAG_ID = f"{DAG_ID_PREFIX}invalid_policies"


def has_per_tenant_rules(policy: RetentionPolicy) -> bool:
    """Whether the policy's statements test each row against its tenant's own cutoff and the cap."""
    return policy.tenant_column is not None and bool(
        policy.tenant_retention or policy.tenant_retention_table is not None or policy.max_rows_per_tenant
    )


def policy_dag_id(policy: RetentionPolicy) -> str:
    """The id of the DAG that runs ``policy``: its ``dag_id``, else ``retention_<name>``."""
    return policy.dag_id or f"{DAG_ID_PREFIX}{policy.name}"


def problem_dag_ids(valid_names: Iterable[str], problems: Iterable[PolicyError]) -> dict[str, list[str]]:
    """Where each invalid policy is shown: its usual DAG id ``retention_<name>``, or, for a problem without a
    usable name (an unreadable file, an entry that is not a mapping or has no valid name, a second policy of
    one name), ``retention_invalid_policies``. The DAG file builds a failing DAG under each id; the
    Retention view shows each problem to the users who may read that DAG.

    :param valid_names: the names of the policies that are valid (their ids are taken).
    :param problems: the errors of the invalid policies.
    :returns: the problems' messages by DAG id, in the order given.
    """
    taken = {f"{DAG_ID_PREFIX}{name}" for name in valid_names}
    bad: dict[str, list[str]] = {}
    for problem in problems:
        name = problem.policy
        dag_id = f"{DAG_ID_PREFIX}{name}" if isinstance(name, str) and _NAME.match(name) else None
        if dag_id is None or dag_id in taken:  # no usable name, or the id of a valid policy of the same name
            dag_id = INVALID_POLICIES_DAG_ID
        bad.setdefault(dag_id, []).append(str(problem))
    if INVALID_POLICIES_DAG_ID in bad and INVALID_POLICIES_DAG_ID in taken:  # a valid policy named invalid_policies
        bad[f"{INVALID_POLICIES_DAG_ID}_entries"] = bad.pop(INVALID_POLICIES_DAG_ID)
    return bad


def load_policies_lenient(path: str | Path) -> tuple[list[RetentionPolicy], list[PolicyError]]:
    """Load a YAML policies file, keeping the good policies and the errors of the bad ones.

    The file holds ``policies:`` (a list of mappings) and an optional ``defaults:`` mapping merged under
    each policy. A file that cannot be read at all raises ``PolicyError``.
    """
    import yaml

    source = Path(path)
    try:
        doc = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError(None, None, f"cannot read policies file {source}: {exc}") from exc
    # Unknown keys first: "polices:" is a typo of "policies", not a file without a policies list.
    unknown = sorted(set(doc) - {"policies", "defaults"}, key=str) if isinstance(doc, dict) else []
    if unknown:
        hint = unknown_key_hint(unknown[0], ("policies", "defaults"))
        raise PolicyError(None, unknown[0], f"unknown top-level key in {source}{hint}")
    if not isinstance(doc, dict) or not isinstance(doc.get("policies"), list):
        raise PolicyError(None, "policies", f"{source} must hold a mapping with a 'policies' list")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise PolicyError(None, "defaults", "must be a mapping")
    policies: list[RetentionPolicy] = []
    errors: list[PolicyError] = []
    seen: set[str] = set()
    for index, entry in enumerate(doc["policies"]):
        if not isinstance(entry, dict):
            errors.append(PolicyError(f"#{index + 1}", None, "each policy must be a mapping"))
            continue
        try:
            policy = RetentionPolicy.from_dict(entry, defaults=defaults)
        except PolicyError as exc:
            errors.append(exc)
            continue
        if policy.name in seen:
            errors.append(PolicyError(policy.name, "name", "is used by more than one policy"))
            continue
        seen.add(policy.name)
        policies.append(policy)
    return policies, errors


def policy_to_dict(policy: RetentionPolicy) -> dict[str, Any]:
    """The policy as a plain mapping that ``RetentionPolicy.from_dict`` reads back (a trigger's
    serialised form, logs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, (TableName, Retention)):
            value = str(value)
        elif f.name == "tenant_retention":
            value = {tenant: str(duration) for tenant, duration in value}
        elif isinstance(value, Throttle):
            value = value.to_dict()
        elif isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    for yaml_key, attr in _RENAMED.items():
        out[yaml_key] = out.pop(attr)
    return out
