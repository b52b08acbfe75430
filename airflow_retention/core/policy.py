"""``RetentionPolicy``: the validated, immutable description of one retention rule."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from airflow_retention.core.durations import Retention, parse_timeout_ms
from airflow_retention.core.errors import PolicyError
from airflow_retention.core.identifiers import TableName, check_ident

MIN_BATCH_SIZE = 1
MAX_BATCH_SIZE = 100_000
MAX_CHUNK_ROWS = 100_000_000
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
DEFAULT_START_DATE = datetime(2025, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class RetentionPolicy:
    """One retention rule: which rows of which table expire, and how to delete them.

    :param name: the policy's identity, a slug (``[a-z][a-z0-9_]*``); used in run keys and DAG ids.
    :param conn_id: the Airflow Postgres connection of the target database.
    :param table: the target table, optionally schema-qualified (``schema.table``); taken literally.
    :param key_column: a unique, indexed integer or bigint column; chunks and batches are ranges of it.
    :param timestamp_column: the timestamptz (or timestamp, read as UTC) column compared with the cutoff.
    :param retention: how long rows are kept: ``"90 days"``, ``"P90D"``, ``"1 year"`` or a timedelta.
    :param condition: extra eligibility, trusted SQL written by the DAG author, re-checked by every
        DELETE and wrapped in parentheses. Never build it from user input.
    :param tenant_column: plan chunks per tenant of this column.
    :param batch_size: rows per transaction, 1 to 100,000.
    :param chunk_rows: eligible rows per chunk (one mapped task), at least ``batch_size``.
    :param lock_timeout: ``lock_timeout`` set in every batch transaction (``"5s"``, ms as int).
    :param statement_timeout: ``statement_timeout`` set in every batch transaction.
    :param dry_run: count what would be deleted and delete nothing.
    :param archive_table: move deleted rows into this table in the same transaction (same column names).
    :param ledger_schema: the schema of the ledger tables in the target database.
    :param schedule: the DAG's schedule.
    :param start_date: the DAG's start date.
    :param catchup: whether the scheduler creates runs for missed intervals.
    :param pool: Airflow pool the chunk tasks run in (the database budget).
    :param max_active_chunks: chunk tasks of one run running at once.
    :param retries: retries of every task (exponential backoff).
    :param retry_delay: the first retry's delay (``"30s"``); it doubles up to 10 minutes.
    :param tags: extra DAG tags.
    :param description: free text shown in the DAG's documentation.
    """

    name: str
    conn_id: str
    table: TableName
    key_column: str
    timestamp_column: str
    retention: Retention
    condition: str | None = None
    tenant_column: str | None = None
    batch_size: int = 5000
    chunk_rows: int = 250_000
    lock_timeout_ms: int = 5_000
    statement_timeout_ms: int = 60_000
    dry_run: bool = False
    archive_table: TableName | None = None
    ledger_schema: str = "retention"
    schedule: str | None = "@daily"
    start_date: datetime = DEFAULT_START_DATE
    catchup: bool = False
    pool: str | None = None
    max_active_chunks: int = 4
    retries: int = 3
    retry_delay_ms: int = 30_000
    tags: tuple[str, ...] = field(default_factory=tuple)
    description: str | None = None

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
        unknown = sorted(set(merged) - _YAML_KEYS)
        if unknown:
            raise PolicyError(label, unknown[0], f"unknown key (known keys: {', '.join(sorted(_YAML_KEYS))})")
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
            ("key column", f"`{self.key_column}`"),
            ("timestamp column", f"`{self.timestamp_column}`"),
            ("retention", str(self.retention)),
            ("condition", f"`{self.condition}`" if self.condition else "none"),
            ("tenant column", f"`{self.tenant_column}`" if self.tenant_column else "none"),
            ("batch size / chunk rows", f"{self.batch_size:,} / {self.chunk_rows:,}"),
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
            f" `{self.timestamp_column}` < cutoff"
            + (" and the condition holds" if self.condition else "")
            + " at the moment of the DELETE. Runs of the same date share the cutoff and the ledger entry,"
            " so re-running or backfilling a date is harmless.\n"
        )


_REQUIRED = ("name", "conn_id", "table", "key_column", "timestamp_column", "retention")
_RENAMED = {
    "lock_timeout": "lock_timeout_ms",
    "statement_timeout": "statement_timeout_ms",
    "retry_delay": "retry_delay_ms",
}
_YAML_KEYS = ({f.name for f in dataclasses.fields(RetentionPolicy)} - set(_RENAMED.values())) | set(_RENAMED)


def _validated(policy: RetentionPolicy) -> dict[str, Any]:
    """Check every field; return the normalised values. Raises :class:`PolicyError` on the first problem."""
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

    def convert(field_name: str, fn: Any, value: Any) -> Any:
        try:
            return fn(value)
        except ValueError as exc:
            raise fail(field_name, str(exc)) from None

    if not isinstance(policy.conn_id, str) or not policy.conn_id.strip():
        raise fail("conn_id", "must be a non-empty connection id")
    out["table"] = convert("table", TableName.parse, policy.table)
    for col in ("key_column", "timestamp_column"):
        out[col] = convert(col, check_ident, getattr(policy, col))
    if policy.tenant_column is not None:
        out["tenant_column"] = convert("tenant_column", check_ident, policy.tenant_column)
    if out["timestamp_column"] == out["key_column"]:
        raise fail("timestamp_column", "must be another column than key_column")
    if out.get("tenant_column") in (out["key_column"], out["timestamp_column"]):
        raise fail("tenant_column", "must be another column than key_column and timestamp_column")
    out["retention"] = convert("retention", Retention.parse, policy.retention)
    if policy.condition is not None:
        out["condition"] = convert("condition", check_condition, policy.condition)
    out["batch_size"] = _int_in_range(fail, "batch_size", policy.batch_size, MIN_BATCH_SIZE, MAX_BATCH_SIZE)
    out["chunk_rows"] = _int_in_range(fail, "chunk_rows", policy.chunk_rows, 1, MAX_CHUNK_ROWS)
    if out["chunk_rows"] < out["batch_size"]:
        raise fail("chunk_rows", f"must be at least batch_size ({out['batch_size']}), got {out['chunk_rows']}")
    out["lock_timeout_ms"] = convert("lock_timeout", parse_timeout_ms, policy.lock_timeout_ms)
    out["statement_timeout_ms"] = convert("statement_timeout", parse_timeout_ms, policy.statement_timeout_ms)
    if not isinstance(policy.dry_run, bool):
        raise fail("dry_run", f"must be true or false, got {policy.dry_run!r}")
    if policy.archive_table is not None:
        out["archive_table"] = convert("archive_table", TableName.parse, policy.archive_table)
        if out["archive_table"] == out["table"]:
            raise fail("archive_table", "must differ from table")
    out["ledger_schema"] = convert("ledger_schema", check_ident, policy.ledger_schema)
    if policy.schedule is not None and (not isinstance(policy.schedule, str) or not policy.schedule.strip()):
        raise fail("schedule", f"must be a cron expression or preset such as '@daily', got {policy.schedule!r}")
    out["start_date"] = convert("start_date", _aware_datetime, policy.start_date)
    if not isinstance(policy.catchup, bool):
        raise fail("catchup", f"must be true or false, got {policy.catchup!r}")
    if policy.pool is not None and (not isinstance(policy.pool, str) or not policy.pool.strip()):
        raise fail("pool", "must be a pool name")
    out["max_active_chunks"] = _int_in_range(fail, "max_active_chunks", policy.max_active_chunks, 1, 1024)
    out["retries"] = _int_in_range(fail, "retries", policy.retries, 0, 100)
    out["retry_delay_ms"] = convert("retry_delay", parse_timeout_ms, policy.retry_delay_ms)
    tags = policy.tags
    if isinstance(tags, str) or not isinstance(tags, Iterable) or not all(isinstance(t, str) for t in tags):
        raise fail("tags", "must be a list of strings")
    out["tags"] = tuple(tags)
    return out


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


def load_policies_lenient(path: str | Path) -> tuple[list[RetentionPolicy], list[PolicyError]]:
    """Load a YAML policies file, keeping the good policies and the errors of the bad ones.

    The file holds ``policies:`` (a list of mappings) and an optional ``defaults:`` mapping merged under
    each policy. A file that cannot be read at all raises :class:`PolicyError`.
    """
    import yaml

    source = Path(path)
    try:
        doc = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError(None, None, f"cannot read policies file {source}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("policies"), list):
        raise PolicyError(None, "policies", f"{source} must hold a mapping with a 'policies' list")
    unknown = set(doc) - {"policies", "defaults"}
    if unknown:
        raise PolicyError(None, sorted(unknown)[0], f"unknown top-level key in {source}")
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
    """The policy as a plain mapping that :meth:`RetentionPolicy.from_dict` reads back (a trigger's
    serialised form, logs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, (TableName, Retention)):
            value = str(value)
        elif isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    for yaml_key, attr in _RENAMED.items():
        out[yaml_key] = out.pop(attr)
    return out
