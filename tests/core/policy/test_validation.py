"""Policy validation: every bad field is refused with the policy and the field named. No database."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import pytest

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.policy.validation import check_condition

from .helpers import BASE, build, refused

# Valid PostgreSQL names once quoted: a policy takes them literally (tests/core/running/test_table_shapes.py
# purges tables named like this). Only what no quoting can hold is refused.
ODD_NAMES = ["users; drop table x", 'a"b', "x--", "a b", "1abc", "a/*b*/", "é", "Created At"]
REFUSED_NAMES = ["", "a\x00b", "x" * 64]


@pytest.mark.parametrize("bad", ["Events", "1events", "events-purge", "events purge", "", "a" * 64])
def test_bad_name_is_refused(bad: str) -> None:
    with pytest.raises(PolicyError) as info:
        build(name=bad)
    assert info.value.field == "name"


def test_key_column_is_optional_with_block_chunks_only() -> None:
    data = {k: v for k, v in BASE.items() if k != "key_column"}
    assert RetentionPolicy.from_dict(data).chunk_by == "block"
    assert RetentionPolicy.from_dict(data).key_column is None
    with pytest.raises(PolicyError) as info:
        RetentionPolicy.from_dict({**data, "chunk_by": "key"})
    assert info.value.field == "key_column" and "chunk_by 'block' needs no key" in str(info.value)


def test_chunk_by_defaults_to_block_with_or_without_tenants() -> None:
    assert build().chunk_by == "block"
    assert build(tenant_column="tenant_id").chunk_by == "block"  # one pass over every tenant
    assert build(chunk_by="key").chunk_by == "key"


@pytest.mark.parametrize("value", [*REFUSED_NAMES, "public.users.extra", "public.", ".users", 'public."users', 'a"b.c'])
def test_bad_table_name_is_refused(value: str) -> None:
    refused("table", table=value)


@pytest.mark.parametrize("value", ODD_NAMES)
def test_odd_table_names_are_taken_literally(value: str) -> None:
    if '"' not in value:  # a bare name may hold anything but a quote or a dot
        assert build(table=value).table == TableName(None, value)
    assert build(table=f'"my schema"."{value.replace(chr(34), 2 * chr(34))}"').table == TableName("my schema", value)


@pytest.mark.parametrize("field", ["key_column", "timestamp_column", "tenant_column", "ledger_schema"])
@pytest.mark.parametrize("value", REFUSED_NAMES)
def test_bad_identifier_is_refused(field: str, value: str) -> None:
    refused(field, **{field: value})


@pytest.mark.parametrize("field", ["key_column", "timestamp_column", "tenant_column", "ledger_schema"])
def test_a_quoted_pair_is_not_one_identifier(field: str) -> None:
    refused(field, **{field: '"a"."b"'})


@pytest.mark.parametrize("field", ["key_column", "timestamp_column", "tenant_column", "ledger_schema"])
@pytest.mark.parametrize("value", ODD_NAMES)
def test_odd_identifiers_are_taken_literally(field: str, value: str) -> None:
    assert getattr(build(**{field: value}), field) == value
    quoted = '"' + value.replace('"', '""') + '"'
    assert getattr(build(**{field: quoted}), field) == value  # the SQL-quoted spelling means the same


@pytest.mark.parametrize("value", ['public."a', "a.b.c", ""])
def test_bad_archive_table_is_refused(value: str) -> None:
    refused("archive_table", archive_table=value)


def test_archive_table_must_differ_from_table() -> None:
    refused("archive_table", archive_table="public.events")


def test_tenant_column_must_differ_from_key_and_timestamp() -> None:
    refused("tenant_column", tenant_column="id")
    refused("tenant_column", tenant_column="created_at")


def test_mixed_case_and_reserved_words_are_taken_literally() -> None:
    policy = build(table="public.Order", key_column="Id", timestamp_column="select", tenant_column="user")
    assert policy.table == TableName("public", "Order")
    assert policy.table.sql == '"public"."Order"'
    assert str(policy.table) == "public.Order"
    assert (policy.key_column, policy.timestamp_column, policy.tenant_column) == ("Id", "select", "user")
    user = build(table="user")
    assert user.table == TableName(None, "user")
    assert user.table.sql == '"user"'


@pytest.mark.parametrize("value", ["0 days", "P0D", "PT0S", "-5 days", "- 1 year", timedelta(0), timedelta(days=-1)])
def test_zero_or_negative_retention_is_refused(value: object) -> None:
    refused("retention", retention=value)


@pytest.mark.parametrize("value", ["soon", "90", "90 parsecs", 90, 1.5, None, "1.5 days"])
def test_unreadable_retention_is_refused(value: object) -> None:
    refused("retention", retention=value)


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "5000", True, 1.5, None])
def test_batch_size_out_of_range_is_refused(value: object) -> None:
    refused("batch_size", batch_size=value)


@pytest.mark.parametrize("value", [1, 100_001, 1_000_000])
def test_batch_size_bounds_are_accepted(value: int) -> None:
    assert build(batch_size=value, chunk_rows=1_000_000).batch_size == value


def test_chunk_rows_below_batch_size_is_refused() -> None:
    error = refused("chunk_rows", batch_size=5000, chunk_rows=4999)
    assert "5000" in str(error)
    assert build(batch_size=5000, chunk_rows=5000).chunk_rows == 5000


@pytest.mark.parametrize("value", [0, -10, 100_000_001, "many"])
def test_chunk_rows_out_of_range_is_refused(value: object) -> None:
    refused("chunk_rows", chunk_rows=value)


BAD_CONDITIONS = [
    "true) or (true",
    "status = 'x') or (true",
    "a = 1;",
    "a = 1; delete from users",
    ";",
    "a = 1 -- trailing comment",
    "a = 1 /* comment */",
    "(a = 1",
    "a = 1)",
    ")(",
    "status = 'unterminated",
    '"unterminated = 1',
    "a = $$x$$",
    "a = $tag$x$tag$",
    "",
    "   ",
]


@pytest.mark.parametrize("condition", BAD_CONDITIONS)
def test_bad_condition_is_refused(condition: str) -> None:
    refused("condition", condition=condition)


@pytest.mark.parametrize(
    "condition",
    [
        "status = 'a;b -- c) /* d'",
        "note = 'it''s ) fine'",
        '"odd)name" = 1',
        '"say ""hi"" (" = 1',
        "(a = 1) and (b in ('x', 'y'))",
        "a - -1 > 0",
        "price::numeric > 0 and note is null",
    ],
)
def test_good_condition_is_accepted_and_kept(condition: str) -> None:
    assert build(condition=f"  {condition}\n").condition == condition


@pytest.mark.parametrize(
    "condition",
    [
        # E'\'' is one string to PostgreSQL, but the checker reads \' as the end of the string and ''
        # as an escaped quote: it then thinks ") or (true --" is inside a string. PostgreSQL sees
        # (status = E'\'') OR (true --comment), which makes every row of the table eligible.
        "status = E'\\'' ) or (true --'",
        "status = E'\\'' ) or (true) or (status = E'\\''",
        # A dollar quote whose tag holds a digit or a non-ASCII letter is not recognised as one: the
        # checker takes its ' for the start of a string, PostgreSQL reads (status = $a1$'$a1$) OR (true.
        "status = $a1$'$a1$ ) or (true --'",
        "status = $é$'$é$ ) or (true --'",
        # '$' is refused wherever it stands: a positional parameter means nothing in a policy.
        "price::numeric > 0 and $1 is null",
        # With standard_conforming_strings off, a backslash escapes a quote in any string.
        "status = '\\' ) or (true --'",
    ],
)
def test_condition_cannot_escape_through_quoting_the_checker_misreads(condition: str) -> None:
    refused("condition", condition=condition)


def test_check_condition_strips_and_rejects_non_strings() -> None:
    assert check_condition("  a = 1 ") == "a = 1"
    with pytest.raises(ValueError):
        check_condition(42)


@pytest.mark.parametrize(
    ("field", "yaml_key", "value", "expected"),
    [
        ("lock_timeout_ms", "lock_timeout", "5s", 5000),
        ("lock_timeout_ms", "lock_timeout", "500ms", 500),
        ("statement_timeout_ms", "statement_timeout", "1.5s", 1500),
        ("statement_timeout_ms", "statement_timeout", "2 min", 120_000),
        ("statement_timeout_ms", "statement_timeout", 2500, 2500),
        ("retry_delay_ms", "retry_delay", timedelta(seconds=30), 30_000),
    ],
)
def test_timeouts_are_read_as_milliseconds(field: str, yaml_key: str, value: object, expected: int) -> None:
    assert getattr(build(**{yaml_key: value}), field) == expected


@pytest.mark.parametrize("value", ["0s", "0ms", -1, 0, "2 days", "fast", True, 1.5, "25 hours"])
@pytest.mark.parametrize("key", ["lock_timeout", "statement_timeout"])
def test_bad_timeout_is_refused(key: str, value: object) -> None:
    refused(key, **{key: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_run", "yes"),
        ("catchup", 1),
        ("conn_id", ""),
        ("conn_id", 5),
        ("schedule", ""),
        ("pool", " "),
        ("max_active_chunks", 0),
        ("retries", -1),
        ("tags", "events"),
        ("tags", [1, 2]),
        ("start_date", "not a date"),
    ],
)
def test_other_bad_fields_are_refused(field: str, value: object) -> None:
    refused(field, **{field: value})


def test_naive_start_date_is_read_as_utc() -> None:
    assert build(start_date=date(2026, 2, 3)).start_date == datetime(2026, 2, 3, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("written", "read"),
    [(False, "off"), (True, "on"), ("OFF", "off"), ("server", "server"), ("remote_apply", "remote_apply")],
)
def test_synchronous_commit_reads_yamls_bare_off_and_on(written: object, read: str) -> None:
    assert build().synchronous_commit == "off"
    assert build(synchronous_commit=written).synchronous_commit == read


@pytest.mark.parametrize(("field", "bad"), [("synchronous_commit", "sometimes"), ("wal_compression", "gzip")])
def test_a_server_setting_outside_its_values_is_refused(field: str, bad: str) -> None:
    assert "must be one of" in str(refused(field, **{field: bad}))
    # YAML's bare `off` is the setting's off, not a boolean the field refuses.
    assert build(wal_compression=False).wal_compression == "off"
