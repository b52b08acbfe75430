"""Per-tenant cutoffs: ``tenant_retention`` and ``tenant_retention_table``, frozen once per run.

The planner computes every overriding tenant's cutoff from the run's anchor (the run date the cutoff
was frozen from), checks each tenant value against the tenant column's type, and records them in the
ledger with the plan (``tenant_cutoffs``). Chunk tasks and the verify sensor read them back from the
ledger, never from the policy, so a change of the map or of the lookup table takes effect at the next
run, never in the middle of one. Every statement then tests each row against its own tenant's cutoff
(:func:`airflow_retention.core.sql.eligibility`), and leaves out the tenants that reached
``max_rows_per_tenant`` in this run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from airflow_retention.core import dbapi
from airflow_retention.core.catalog import TargetInfo
from airflow_retention.core.durations import Retention
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.identifiers import quote_ident
from airflow_retention.core.ledger import Ledger
from airflow_retention.core.policy import RetentionPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantCutoffs:
    """The cutoffs a run applies: one for every tenant, and the frozen overrides of some tenants.

    :param cutoff: the run's cutoff (``retention`` before the run's date).
    :param overrides: (tenant, retention, cutoff, source) of each tenant with a retention of its own.
    :param excluded: tenants left out of the batches (their ``max_rows_per_tenant`` is reached).
    """

    cutoff: datetime
    overrides: tuple[tuple[str, str, datetime, str], ...] = ()
    excluded: tuple[str, ...] = field(default_factory=tuple)

    @property
    def earliest(self) -> datetime:
        """The earliest cutoff of any tenant: every row before it is expired by time, whatever its tenant."""
        return min([self.cutoff, *(c for _, _, c, _ in self.overrides)])

    @property
    def latest(self) -> datetime:
        """No row at or after this is eligible for any tenant."""
        return max([self.cutoff, *(c for _, _, c, _ in self.overrides)])

    def params(self) -> dict[str, Any]:
        """The query parameters of :func:`~airflow_retention.core.sql.eligibility`."""
        return {
            "cutoff": self.cutoff,
            "ot": [t for t, _, _, _ in self.overrides],
            "oc": [c for _, _, c, _ in self.overrides],
            "latest_cutoff": self.latest,
            "xt": list(self.excluded),
        }

    def excluding(self, tenants: list[str]) -> TenantCutoffs:
        return TenantCutoffs(self.cutoff, self.overrides, tuple(tenants))

    def cutoff_of(self, tenant: str) -> datetime:
        return next((c for t, _, c, _ in self.overrides if t == tenant), self.cutoff)


def frozen(conn: Any, ledger: Ledger, policy: RetentionPolicy, run_key: str, cutoff: datetime) -> TenantCutoffs:
    """The run's cutoffs as its planner froze them in the ledger (none recorded: the run's cutoff for all)."""
    if not has_per_tenant_rules(policy):
        return TenantCutoffs(cutoff)
    return TenantCutoffs(cutoff, tuple(ledger.tenant_cutoffs(conn, run_key)))


def has_per_tenant_rules(policy: RetentionPolicy) -> bool:
    """Whether the policy's statements test each row against its tenant's own cutoff and the cap."""
    return policy.tenant_column is not None and bool(
        policy.tenant_retention or policy.tenant_retention_table is not None or policy.max_rows_per_tenant
    )


def compute(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoff: datetime, anchor: datetime
) -> TenantCutoffs:
    """The overrides of a run whose date is ``anchor``: the lookup table's, then the policy's map over it.
    Raises :class:`PermanentError` naming the field for a tenant value the column cannot hold, a lookup
    table without its columns, or a retention that is not positive; nothing is written."""
    found: dict[str, tuple[Retention | str, str]] = {}
    if policy.tenant_retention_table is not None:
        for tenant, retention in _read_table(conn, policy, target):
            found[tenant] = (retention, "table")
    for tenant, retention in policy.tenant_retention:
        found[tenant] = (retention, "policy")
    if not found:
        return TenantCutoffs(cutoff)
    _check_tenant_values(conn, policy, target, list(found))
    overrides = []
    table_rows = {t: r for t, (r, s) in found.items() if s == "table"}
    table_cutoffs = _table_cutoffs(conn, anchor, table_rows) if table_rows else {}
    for tenant, (retention, source) in sorted(found.items()):
        if isinstance(retention, Retention):
            moment = retention.before(anchor)
            tenant_cutoff = datetime.fromtimestamp(moment.timestamp(), tz=timezone.utc)
            overrides.append((tenant, str(retention), tenant_cutoff, source))
        else:
            overrides.append((tenant, retention, table_cutoffs[tenant], source))
    log.info(
        "policy %s: %d tenant(s) with a retention of their own: %s",
        policy.name,
        len(overrides),
        ", ".join(f"{t} ({r}, cutoff {c:%Y-%m-%d %H:%M:%S}Z)" for t, r, c, _ in overrides[:10])
        + (" …" if len(overrides) > 10 else ""),
    )
    return TenantCutoffs(cutoff, tuple(overrides))


def _read_table(conn: Any, policy: RetentionPolicy, target: TargetInfo) -> list[tuple[str, str]]:
    table = policy.tenant_retention_table
    assert table is not None and policy.tenant_column is not None
    where = f"policy {policy.name!r}: field 'tenant_retention_table'"
    columns = dbapi.fetch_all(
        conn,
        "SELECT a.attname::text, format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a"
        " WHERE a.attrelid = to_regclass(%(t)s) AND a.attnum > 0 AND NOT a.attisdropped",
        {"t": table.regclass_literal},
    )
    if not columns:
        raise PermanentError(f"{where}: table {table} does not exist (or this role cannot see it)")
    types = dict(columns)
    lacking = [c for c in (policy.tenant_column, "retention") if c not in types]
    if lacking:
        raise PermanentError(
            f"{where}: {table} lacks column(s) {', '.join(lacking)}; it needs the tenant column"
            f" {policy.tenant_column!r} and an interval column 'retention'"
        )
    if types["retention"] != "interval":
        raise PermanentError(f"{where}: column 'retention' of {table} is {types['retention']}, not interval")
    rows = dbapi.fetch_all(
        conn,
        f"SELECT {quote_ident(policy.tenant_column)}::text, retention::text, retention > interval '0'"
        f" FROM {table.sql} WHERE retention IS NOT NULL AND {quote_ident(policy.tenant_column)} IS NOT NULL",
    )
    bad = [(t, r) for t, r, positive in rows if not positive]
    if bad:
        raise PermanentError(f"{where}: tenant {bad[0][0]!r} has retention {bad[0][1]}; it must be positive")
    return [(t, r) for t, r, _ in rows]


def _table_cutoffs(conn: Any, anchor: datetime, rows: dict[str, Retention | str]) -> dict[str, datetime]:
    """``anchor - interval`` in UTC, by the server (calendar-aware, as for ``retention``)."""
    tenants = list(rows)
    found = dbapi.fetch_all(
        conn,
        "SELECT t, ((%(a)s::timestamptz AT TIME ZONE 'UTC') - r::interval) AT TIME ZONE 'UTC'"
        " FROM unnest(%(t)s::text[], %(r)s::text[]) AS x(t, r)",
        {"a": anchor, "t": tenants, "r": [str(rows[t]) for t in tenants]},
    )
    return dict(found)


def _check_tenant_values(conn: Any, policy: RetentionPolicy, target: TargetInfo, tenants: list[str]) -> None:
    """Every overriding tenant value must be a value of the tenant column's type."""
    for tenant in tenants:
        try:
            dbapi.fetch_all(conn, f"SELECT %(t)s::text::{target.tenant_type}", {"t": tenant})
        except PermanentError:
            raise PermanentError(
                f"policy {policy.name!r}: field 'tenant_retention': tenant {tenant!r} is not a value of column"
                f" {policy.tenant_column!r} ({target.tenant_type}); nothing was deleted"
            ) from None
