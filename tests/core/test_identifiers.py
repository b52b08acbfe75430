"""Identifier validation and quoting; the quoted names are checked against the real PostgreSQL too."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.identifiers import TableName, check_ident, quote_ident

from .helpers import rows, scalar


@pytest.mark.parametrize(
    ("name", "quoted"),
    [("user", '"user"'), ("select", '"select"'), ("Order", '"Order"'), ("group", '"group"'), ("a$b_1", '"a$b_1"')],
)
def test_quote_ident(name: str, quoted: str) -> None:
    assert quote_ident(name) == quoted


@pytest.mark.parametrize("bad", ["users; drop table x", 'a"b', "x--", "a b", "1x", "", "a.b", "a\x00b", "x" * 64])
def test_bad_identifiers_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        check_ident(bad)
    with pytest.raises(ValueError):
        quote_ident(bad)


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
    bare = TableName.parse("user")
    assert (bare.schema, bare.name, bare.sql, str(bare)) == (None, "user", '"user"', "user")
    assert TableName.parse(qualified) is qualified


@pytest.mark.parametrize("bad", ["a.b.c", "a.", ".b", "a;b.c", 'a."b"', "a. b"])
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
