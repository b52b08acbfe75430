"""Validation and quoting of SQL identifiers.

Every identifier that reaches SQL goes through :func:`quote_ident`; policy values are never pasted in
unquoted. Names are taken literally (case-sensitive), exactly as PostgreSQL treats a quoted name, so
``Order`` means the table ``"Order"`` and reserved words such as ``user`` are fine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Deliberately narrower than what PostgreSQL accepts inside double quotes: a policy never needs a name
# with spaces, quotes or punctuation, and refusing them early makes injection attempts fail at
# validation with a readable message instead of as a strange catalog miss.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
MAX_IDENT_BYTES = 63


def check_ident(value: object) -> str:
    """Return ``value`` if it is a valid identifier, else raise ``ValueError`` saying why."""
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError("must not be empty")
    if len(value.encode()) > MAX_IDENT_BYTES:
        raise ValueError(f"{value!r} is longer than {MAX_IDENT_BYTES} bytes")
    if not _IDENT.match(value):
        raise ValueError(f"{value!r} is not a valid identifier (letters, digits, _ and $, not starting with a digit)")
    return value


def quote_ident(name: str) -> str:
    """Quote one identifier for PostgreSQL."""
    check_ident(name)
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class TableName:
    """A possibly schema-qualified table name."""

    schema: str | None
    name: str

    @classmethod
    def parse(cls, value: object) -> TableName:
        if isinstance(value, TableName):
            return value
        if not isinstance(value, str):
            raise ValueError(f"must be a string like 'schema.table', got {type(value).__name__}")
        parts = value.split(".")
        if len(parts) > 2:
            raise ValueError(f"{value!r} has more than one dot; use 'schema.table'")
        for part in parts:
            check_ident(part)
        return cls(parts[0], parts[1]) if len(parts) == 2 else cls(None, parts[0])

    @property
    def sql(self) -> str:
        """The quoted, possibly qualified name, ready for SQL."""
        if self.schema is None:
            return quote_ident(self.name)
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"

    @property
    def regclass_literal(self) -> str:
        """The quoted name as text, to pass as a *parameter* to ``%s::regclass`` or ``to_regclass``."""
        return self.sql

    def __str__(self) -> str:
        return self.name if self.schema is None else f"{self.schema}.{self.name}"
