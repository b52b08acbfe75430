"""Identifier validation and quoting; the quoted names are checked against the real PostgreSQL too."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.policy.identifiers import TableName, check_ident, quote_ident
from tests.core.helpers import rows, scalar


@pytest.mark.parametrize(
    ("name", "quoted"),
    [("user", '"user"'), ("select", '"select"'), ("Order", '"Order"'), ("group", '"group"'), ("a$b_1", '"a$b_1"')],
)
def test_quote_ident(name: str, quoted: str) -> None:
    assert quote_ident(name) == quoted


# Names that need quoting: punctuation, quotes, spaces, a leading digit, non-ASCII. All of them are
# valid PostgreSQL names when quoted, and quoting makes each one a single name whatever it holds.
ODD_NAMES = ["users; drop table x", 'a"b', "x--", "a b", "1x", "a.b", "Tenant Data", "é", 'x"; drop table y; --']


@pytest.mark.parametrize("name", ODD_NAMES)
def test_any_name_is_taken_literally_and_quoted(name: str) -> None:
    assert check_ident(name) == name
    assert quote_ident(name) == '"' + name.replace('"', '""') + '"'


@pytest.mark.parametrize(("written", "name"), [('"Created At"', "Created At"), ('"a""b"', 'a"b'), ('"a.b"', "a.b")])
def test_a_name_may_be_written_sql_quoted(written: str, name: str) -> None:
    assert check_ident(written) == name


@pytest.mark.parametrize("bad", ["", "a\x00b", "x" * 64, '"a"."b"', '"open', '"a".b'])
def test_bad_identifiers_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_ident(bad)


def test_sixty_three_bytes_is_the_limit() -> None:
    assert check_ident("x" * 63) == "x" * 63
    with pytest.raises(ValueError):
        check_ident("é" * 32)  # 64 bytes


def test_non_string_is_refused() -> None:
    with pytest.raises(ValueError):
        check_ident(5)
    with pytest.raises(ValueError):
        TableName.parse(5)


def test_table_name_parse() -> None:
    qualified = TableName.parse("public.Order")
    assert (qualified.schema, qualified.name) == ("public", "Order")
    assert qualified.sql == '"public"."Order"'
    assert qualified.regclass_literal == '"public"."Order"'
    assert str(qualified) == "public.Order"
    assert str(TableName("Tenant Data", "order")) == '"Tenant Data".order'
    bare = TableName.parse("user")
    assert (bare.schema, bare.name, bare.sql, str(bare)) == (None, "user", '"user"', "user")
    assert TableName.parse(qualified) is qualified


@pytest.mark.parametrize(
    ("written", "schema", "name"),
    [
        ('"Tenant Data"."order"', "Tenant Data", "order"),
        ("Tenant Data.order", "Tenant Data", "order"),
        ('"my.schema"."a""b"', "my.schema", 'a"b'),
        ('public."x; drop table y"', "public", "x; drop table y"),
        ('"one.name"', None, "one.name"),
    ],
)
def test_quoted_qualified_names(written: str, schema: str | None, name: str) -> None:
    parsed = TableName.parse(written)
    assert (parsed.schema, parsed.name) == (schema, name)
    assert TableName.parse(str(parsed)) == parsed  # what logs and the ledger show reads back


@pytest.mark.parametrize("bad", ["a.b.c", "a.", ".b", 'a."b', 'a"b.c', "a. b", '"a"b', '"a".', ""])
def test_table_name_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        TableName.parse(bad)


def test_quoted_names_reach_the_intended_objects(admin: Any, schema: str) -> None:
    """Reserved and mixed-case names work as quoted, and are distinct from their lower-case twins."""
    table = TableName.parse(f"{schema}.Order")
    rows(admin, f"CREATE TABLE {table.sql} ({quote_ident('user')} int, {quote_ident('Select')} int)")
    rows(admin, f'CREATE TABLE "{schema}"."order" (x int)')
    rows(admin, f"INSERT INTO {table.sql} VALUES (1, 2)")
    assert scalar(admin, f"SELECT {quote_ident('user')} + {quote_ident('Select')} FROM {table.sql}") == 3
    assert scalar(
        admin,
        "SELECT to_regclass(%(t)s)::oid <> to_regclass(%(u)s)::oid",
        {
            "t": table.regclass_literal,
            "u": f'"{schema}"."order"',
        },
    )
