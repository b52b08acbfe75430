"""The checks of a policy's fields: :func:`validated_fields` checks and normalises every field of a
``RetentionPolicy`` being built, with the limits it enforces; :func:`check_condition` keeps a condition
inside its parentheses.

This module works on the values it is given and never imports :mod:`.model` (which calls it from
``RetentionPolicy.__post_init__``): the policy passed in is only read through its attributes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import date, datetime, timezone
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.budget import Budget
from airflow_retention.core.policy.durations import Retention, parse_timeout_ms, parse_window
from airflow_retention.core.policy.identifiers import TableName, check_ident
from airflow_retention.core.policy.throttle import Throttle

MIN_BATCH_SIZE = 1
MAX_BATCH_SIZE = 1_000_000
DEFAULT_MIN_BATCH_SIZE = 500
DEFAULT_MAX_BATCH_SIZE = 500_000
MAX_CHUNK_ROWS = 100_000_000
MIN_TARGET_CHUNK_MS = 1_000
# A policy's name: it goes into run keys and DAG ids.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_DAG_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")
CHUNK_BY = ("key", "block")
# What happens to a partition whose whole range is expired (docs/policies.md).
EXPIRED_PARTITIONS = ("delete", "detach", "drop")
# "server": the server's own; "auto": lz4 when the role may set it; else the value set in every batch.
WAL_COMPRESSION = ("server", "auto", "lz4", "zstd", "pglz", "off")
SYNCHRONOUS_COMMIT = ("off", "server", "local", "remote_write", "on", "remote_apply")


def validated_fields(policy: Any) -> dict[str, Any]:
    """Check every field; return the normalised values. Raises ``PolicyError`` on the first problem.

    :param policy: the ``RetentionPolicy`` being built, its fields as given (read, never changed).
    """
    name = policy.name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
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
    out["budget"] = convert("budget", Budget.from_value, policy.budget)
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
    if policy.cleanup_window is not None:
        out["cleanup_window"] = convert("cleanup_window", parse_window, policy.cleanup_window)
    asset = policy.asset
    if asset is not None and asset is not False:
        out["asset"] = convert("asset", lambda v: check_asset(v, out["table"]), asset)
    else:
        out["asset"] = None
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


def check_asset(value: object, table: TableName) -> bool | str:
    """The ``asset`` field: ``True`` (the asset's URI is made from the connection when the DAG is parsed,
    so the table must name its schema), or a ``postgres://host[:port]/database/schema/table`` URI of the
    policy's own table, returned with Airflow's normal form (``postgres``, port 5432 when none is given).
    ``False`` and ``None`` mean no asset, and never reach here."""
    if value is True:
        if table.schema is None:
            raise ValueError(
                f"needs a schema-qualified table to name its asset (postgres://host:port/database/schema/table);"
                f" write table: public.{table}, or give the asset's URI"
            )
        return True
    if not isinstance(value, str):
        raise ValueError(f"must be true, false or a postgres://host:port/database/schema/table URI, got {value!r}")
    parts = urlsplit(value.strip())
    if parts.scheme not in ("postgres", "postgresql") or not parts.hostname:
        raise ValueError(f"{value!r} is not a postgres://host:port/database/schema/table URI")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"{value!r}: an asset URI of a table takes no user, password, query or fragment")
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if len(path) != 3 or not all(path):
        raise ValueError(f"{value!r}: the path must be /database/schema/table")
    if (table.schema is not None and path[1] != table.schema) or path[2] != table.name:
        raise ValueError(f"{value!r} names table {path[1]}.{path[2]}, not the policy's table {table}")
    try:
        port = parts.port or 5432
    except ValueError as exc:  # a port that is not a number
        raise ValueError(f"{value!r}: {exc}") from None
    return f"postgres://{parts.hostname}:{port}/" + "/".join(quote(p, safe="") for p in path)


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
