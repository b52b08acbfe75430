"""What the catalog says about a target table, as the statements need it (:mod:`..db.catalog` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TargetInfo:
    """The facts about the target table that shape the SQL the engine runs."""

    timestamp_has_tz: bool
    # The tenant column's type as declared, modifier included (character(4), numeric(10,2), a domain):
    # values are cast to it so that rows are compared as stored.
    tenant_type: str | None
    columns: tuple[str, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    partitioned: bool = False
    # The value the batch transactions give wal_compression (SET LOCAL); None: the server's own.
    wal_compression: str | None = None
    # The tenant column's underlying type without any modifier (of a domain: its base type), schema-
    # qualified so that a cast never reads a default length into it (pg_catalog.bpchar): a tenant
    # value must equal itself cast to ``tenant_type``, or the column would store another value.
    tenant_base_type: str | None = None
    # The tenant column's collation, schema-qualified and quoted (``public."ci"``); None for a type that
    # has none (numeric, uuid). Tenant values are compared under it, as the column compares them.
    tenant_collation: str | None = None
