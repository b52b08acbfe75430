"""The oracle: which rows a policy allows to delete, computed in plain Python.

It shares no code with the package: the cutoffs come from :func:`cases.subtract` (PostgreSQL's month
arithmetic, written again), tenants are matched as the column compares them (by how they print, then by
equality class: case-insensitive for citext and a case-insensitive ICU collation, by value for numeric;
:func:`cases.tenant_class`), the condition is
evaluated by :func:`cases.condition_eval` in three-valued logic, and every row's inputs come from a
snapshot read with the suite's own SQL.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any

from .cases import UNFIT, Case, condition_eval, parse_retention, subtract, tenant_class, tenant_text

UTC = timezone.utc


@dataclass(frozen=True)
class RowState:
    """One row as the suite read it: the oracle's inputs, and where it lives."""

    ts: datetime | date | None
    tenant: str | None  # tenant::text
    status: str | None
    n: int | None
    has_ref: bool
    partition: str  # tableoid::regclass::text
    block: int  # from ctid
    key: Any


def canonical_tenant(tenant_type: str, value: Any) -> str:
    """A tenant value of the policy's map or lookup table as the oracle keys tenants: how the column
    prints it, then its equality class (:func:`cases.tenant_class`: 'ACME' is 'acme' in a citext column,
    '7.00' is '7' in a numeric one)."""
    if tenant_type in ("integer", "bigint"):
        return str(int(str(value)))
    if tenant_type == "uuid":
        return str(uuid.UUID(str(value)))
    return tenant_class(tenant_type, tenant_text(tenant_type, value))


@dataclass
class Oracle:
    """The eligibility rule of one case's policy at its run date."""

    case: Case
    policy: dict[str, Any]  # the policy as run (may differ from the case's after an edit)
    condition: list[Any] | None

    @property
    def cutoff(self) -> datetime:
        return subtract(self.case.anchor.astimezone(UTC), parse_retention(self.policy["retention"]))

    def tclass(self, printed: str | None) -> str | None:
        """A row's tenant (as it prints) as the oracle keys tenants: its equality class in the column."""
        return None if printed is None else tenant_class(self.case.table["tenant_type"], printed)

    def tenant_cutoffs(self) -> dict[str, datetime]:
        """Tenants with a cutoff of their own, keyed by equality class: the lookup table's (the longest
        retention wins among entries equal as the column compares them; NULL retentions ignored), then
        the map's over it (the map wins for a tenant both name, however each writes it)."""
        if not self.policy.get("tenant_column"):
            return {}
        tenant_type = self.case.table["tenant_type"]
        anchor = self.case.anchor.astimezone(UTC)
        out: dict[str, datetime] = {}
        if self.policy.get("tenant_retention_table") and self.case.tenant_table:
            for value, retention in self.case.tenant_table:
                if retention is None:
                    continue
                t = canonical_tenant(tenant_type, value)
                c = subtract(anchor, parse_retention(retention))
                out[t] = min(out.get(t, c), c)  # longest retention = earliest cutoff
        mapped: dict[str, datetime] = {}
        for value, retention in (self.policy.get("tenant_retention") or {}).items():
            if value == UNFIT.get(tenant_type):
                continue  # the run must be refused (harness.expected_refusal)
            t = canonical_tenant(tenant_type, value)
            c = subtract(anchor, parse_retention(retention))
            mapped[t] = min(mapped.get(t, c), c)  # two keys naming one tenant: the longest retention
        out.update(mapped)  # the map wins over the table
        return out

    def eligible(self, row: RowState, cutoffs: dict[str, datetime] | None = None) -> bool:
        """Whether the policy allows deleting ``row`` (``max_rows_per_tenant`` aside: it only defers)."""
        if row.ts is None:
            return False
        if self.policy.get("tenant_column") and row.tenant is None:
            return False  # a NULL tenant belongs to no tenant: never eligible (docs/concepts.md)
        cutoffs = self.tenant_cutoffs() if cutoffs is None else cutoffs
        cutoff = cutoffs.get(self.tclass(row.tenant), self.cutoff) if row.tenant is not None else self.cutoff
        if not _before(row.ts, cutoff):
            return False
        if self.condition is not None:
            values = {"status": row.status, "n": row.n, "has_ref": row.has_ref}
            return condition_eval(self.condition, values) is True
        return True

    def eligible_set(self, rows: dict[int, RowState]) -> set[int]:
        cutoffs = self.tenant_cutoffs()
        return {rid for rid, row in rows.items() if self.eligible(row, cutoffs)}


def _before(ts: datetime | date, cutoff: datetime) -> bool:
    """``ts < cutoff`` as the server compares them: timestamptz as instants; a naive timestamp as UTC;
    a date as midnight UTC of that day."""
    if isinstance(ts, datetime):
        if ts.tzinfo is None:
            return ts < cutoff.astimezone(UTC).replace(tzinfo=None)
        return ts < cutoff
    return datetime(ts.year, ts.month, ts.day) < cutoff.astimezone(UTC).replace(tzinfo=None)
