"""Validation and quoting of SQL identifiers.

Every identifier that reaches SQL goes through :func:`quote_ident`; policy values are never pasted in
unquoted. Any name PostgreSQL accepts inside double quotes is accepted here (spaces, capitals, quotes,
punctuation, non-ASCII), up to 63 bytes. Names are taken literally (case-sensitive), exactly as
PostgreSQL treats a quoted name, so ``Order`` means the table ``"Order"`` and reserved words such as
``user`` are fine.

A name may also be written SQL-quoted: ``"Created At"`` is the column ``Created At``, and a qualified
table name whose parts hold a dot or a quote is written ``"Tenant Data"."order"`` (a plain
``schema.table`` keeps working). :func:`display_name` writes a name back in that form, so what the
logs and the ledger show can be pasted into a policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Names that read the same bare and quoted in logs; anything else is shown SQL-quoted.
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
MAX_IDENT_BYTES = 63


def check_ident(value: object) -> str:
    """Return the identifier ``value`` names, else raise ``ValueError`` saying why.

    ``value`` is taken literally, except that a value starting with ``"`` must be one SQL-quoted name
    (``"Created At"``, with ``""`` for a quote inside), which is unquoted.
    """
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    if value.startswith('"'):
        parts = _split_qualified(value)
        if len(parts) != 1:
            raise ValueError(f"{value!r} names more than one identifier")
        return _checked(parts[0], value)
    return _checked(value, value)


def _checked(name: str, written: str) -> str:
    if not name:
        raise ValueError("must not be empty")
    if "\x00" in name:
        raise ValueError(f"{written!r} contains a NUL character, which no PostgreSQL name can hold")
    if len(name.encode()) > MAX_IDENT_BYTES:
        raise ValueError(f"{written!r} is longer than {MAX_IDENT_BYTES} bytes (PostgreSQL would truncate it)")
    return name


def quote_ident(name: str) -> str:
    """Quote one identifier for PostgreSQL (the name itself, not a SQL-quoted spelling of it)."""
    if not isinstance(name, str):
        raise ValueError(f"must be a string, got {type(name).__name__}")
    _checked(name, name)
    return '"' + name.replace('"', '""') + '"'


def display_name(name: str) -> str:
    """The name as a person would write it in a policy: bare when that is unambiguous, else quoted."""
    return name if _PLAIN.match(name) else quote_ident(name)


def _split_qualified(value: str) -> list[str]:
    """Split ``a.b``, ``"a.b"."c"`` or ``a."b ""c"`` into names; raise ``ValueError`` on bad syntax."""
    parts: list[str] = []
    i, n = 0, len(value)
    while True:
        if i < n and value[i] == '"':
            out = []
            i += 1
            while True:
                end = value.find('"', i)
                if end == -1:
                    raise ValueError(f"{value!r} has an unterminated '\"'")
                out.append(value[i:end])
                if end + 1 < n and value[end + 1] == '"':  # a doubled quote stands for one
                    out.append('"')
                    i = end + 2
                    continue
                i = end + 1
                break
            parts.append("".join(out))
        else:
            end = value.find(".", i)
            part = value[i:] if end == -1 else value[i:end]
            if '"' in part:
                raise ValueError(f"{value!r}: a name holding '\"' must be written quoted, with '\"\"' inside")
            if part != part.strip():
                raise ValueError(f"{value!r}: a name with leading or trailing spaces must be written quoted")
            parts.append(part)
            i = n if end == -1 else end
        if i >= n:
            return parts
        if value[i] != ".":
            raise ValueError(f"{value!r}: expected '.' after a quoted name, got {value[i]!r}")
        i += 1
        if i >= n:
            raise ValueError(f"{value!r} ends with '.'")


@dataclass(frozen=True)
class TableName:
    """A possibly schema-qualified table name."""

    schema: str | None
    name: str

    @classmethod
    def parse(cls, value: object) -> TableName:
        """Read ``table``, ``schema.table`` or their SQL-quoted forms (``"Tenant Data"."order"``)."""
        if isinstance(value, TableName):
            return value
        if not isinstance(value, str):
            raise ValueError(f"must be a string like 'schema.table', got {type(value).__name__}")
        parts = _split_qualified(value)
        if len(parts) > 2:
            raise ValueError(
                f"{value!r} names {len(parts)} parts; use 'schema.table', and quote a name that holds a dot:"
                ' \'"my.schema"."table"\''
            )
        for part in parts:
            _checked(part, value)
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
        """The name as written in a policy, read back by :meth:`parse` (quoted only where needed)."""
        if self.schema is None:
            return display_name(self.name)
        return f"{display_name(self.schema)}.{display_name(self.name)}"
