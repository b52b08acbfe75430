"""Per-tenant cutoffs: ``tenant_retention`` and ``tenant_retention_table``, frozen once per run.

The planner computes every overriding tenant's cutoff from the run's anchor (the run date the cutoff
was frozen from), checks each tenant value against the tenant column's type, and records them in the
ledger with the plan (``tenant_cutoffs``). Chunk tasks and the verify sensor read them back from the
ledger, never from the policy, so a change of the map or of the lookup table takes effect at the next
run, never in the middle of one. Every statement then tests each row against its own tenant's cutoff
(:func:`airflow_retention.core.sql.predicate.eligibility`), and leaves out the tenants that reached
``max_rows_per_tenant`` in this run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import require_run_date
from airflow_retention.core.policy.durations import Retention
from airflow_retention.core.policy.identifiers import quote_ident
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules
from airflow_retention.core.sql.target import TargetInfo

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
        """The query parameters of :func:`~airflow_retention.core.sql.predicate.eligibility`."""
        return {
            "cutoff": self.cutoff,
            "ot": [t for t, _, _, _ in self.overrides],
            "oc": [c for _, _, c, _ in self.overrides],
            "latest_cutoff": self.latest,
            "xt": list(self.excluded),
        }

    def cutoff_of(self, tenant: str) -> datetime:
        return next((c for t, _, c, _ in self.overrides if t == tenant), self.cutoff)


def frozen(conn: Any, ledger: Ledger, policy: RetentionPolicy, run_key: str, cutoff: datetime) -> TenantCutoffs:
    """The run's cutoffs as its planner froze them in the ledger (none recorded: the run's cutoff for all).
    A run frozen with per-tenant cutoffs whose policy has lost its per-tenant rules since cannot honour
    them (its statements would not test them): it fails, rather than purge those tenants early. That
    includes a policy that lost its ``tenant_column``: its statements test no tenant at all."""
    # Read the ledger before looking at the policy: the frozen cutoffs, not today's policy, say whether
    # this run has per-tenant rules to honour.
    overrides = tuple(ledger.tenant_cutoffs(conn, run_key))
    if policy.tenant_column is None and not overrides:
        return TenantCutoffs(cutoff)
    if overrides and not has_per_tenant_rules(policy):
        raise PermanentError(
            f"policy {policy.name!r}: run {run_key} was planned with per-tenant retention for"
            f" {len(overrides)} tenant(s), and the policy has none now: restore"
            + (" tenant_column and" if policy.tenant_column is None else "")
            + " tenant_retention (or tenant_retention_table) until the run is complete, or delete the run from"
            " the ledger and plan it again; nothing was deleted"
        )
    return TenantCutoffs(cutoff, overrides)


def compute(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoff: datetime, anchor: datetime
) -> TenantCutoffs:
    """The overrides of a run whose date is ``anchor``: the lookup table's, then the policy's map over it.
    Raises :class:`PermanentError` naming the field for a tenant value the column cannot hold, a lookup
    table without its columns, or a retention that is not positive; nothing is written."""
    found: dict[str, tuple[Retention | str, str]] = {}
    if policy.tenant_retention_table is not None:
        table = _read_table(conn, policy, target)
        canonical = as_printed(conn, policy, target, [t for t, _ in table], "tenant_retention_table")
        longest = _longest_per_tenant(conn, policy, anchor, [(canonical[t], r) for t, r in table])
        for tenant, retention in longest.items():
            found[tenant] = (retention, "table")
    if policy.tenant_retention:
        canonical = as_printed(conn, policy, target, [t for t, _ in policy.tenant_retention], "tenant_retention")
        mapped: dict[str, Retention] = {}
        for tenant, retention in policy.tenant_retention:
            # Two keys the column prints alike ('007' and '7' of an integer column): the longest wins, as above.
            earlier = mapped.get(canonical[tenant])
            if earlier is None or retention.before(anchor) < earlier.before(anchor):
                mapped[canonical[tenant]] = retention
        for tenant, retention in mapped.items():
            found[tenant] = (retention, "policy")
    if not found:
        return TenantCutoffs(cutoff)
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
    (now,) = dbapi.fetch_all(conn, "SELECT now()")[0]
    future = [(t, c) for t, _, c, _ in overrides if c > now]
    if future:
        # A run dated later than now (a lone chunk's cutoff plus a long retention) would purge rows of a
        # tenant with a short retention that have not expired yet.
        raise PermanentError(
            f"policy {policy.name!r}: tenant {future[0][0]!r}'s cutoff {future[0][1]:%Y-%m-%d %H:%M:%S}Z is in the"
            " future (its retention is shorter than the time since this run's date): refusing; nothing was deleted"
        )
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
    # Types without their modifier: only whether 'retention' is an interval matters here (the tenant
    # values are read as text, then checked against the target's column by as_printed).
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


def _longest_per_tenant(
    conn: Any, policy: RetentionPolicy, anchor: datetime, rows: list[tuple[str, str]]
) -> dict[str, str]:
    """One retention per tenant of the lookup table. A tenant listed more than once (no unique index on
    the table, or two values the column prints alike) gets its longest retention, the one that keeps the
    most rows (the earliest cutoff from this run's date; an exact tie, the first in text order), never
    whichever row the scan returned last; a warning names the tenant and its rows."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, retention in rows:
        by_tenant.setdefault(tenant, []).append(retention)
    duplicated = {t: sorted(rs) for t, rs in by_tenant.items() if len(rs) > 1}
    if not duplicated:
        return {t: rs[0] for t, rs in by_tenant.items()}
    pairs = [(t, r) for t, rs in duplicated.items() for r in rs]
    # The server compares the cutoffs, calendar-aware as for ``retention`` ('1 month' against '30 days').
    ordered = dbapi.fetch_all(
        conn,
        "SELECT t, r FROM unnest(%(t)s::text[], %(r)s::text[]) AS x(t, r)"
        " ORDER BY t, (%(a)s::timestamptz AT TIME ZONE 'UTC') - r::interval, r",
        {"a": anchor, "t": [t for t, _ in pairs], "r": [r for _, r in pairs]},
    )
    chosen = {t: rs[0] for t, rs in by_tenant.items()}
    for tenant, retention in reversed(ordered):  # the first row of each tenant (earliest cutoff) wins
        chosen[tenant] = retention
    for tenant, retentions in sorted(duplicated.items()):
        log.warning(
            "policy %s: tenant_retention_table %s lists tenant %r %d times (retention %s): the longest, %s,"
            " applies (it keeps the most rows); remove the duplicate rows",
            policy.name,
            policy.tenant_retention_table,
            tenant,
            len(retentions),
            ", ".join(retentions),
            chosen[tenant],
        )
    return chosen


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


def as_printed(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, tenants: list[str], field_name: str
) -> dict[str, str]:
    """Each tenant value as the tenant column prints it (``'007'`` → ``'7'``, an upper-case uuid → lower
    case): rows are matched by ``tenant_column::text``, so a value written another way would match
    nothing and its tenant would get the default retention. A value the column cannot hold is refused,
    and so is one it would store as another value: a cast to ``character(4)`` or ``varchar(4)`` cuts
    ``'acmecorp'`` to ``'acme'``, ``numeric(5,2)`` rounds 1.005 to 1.01, ``bit(4)`` cuts or pads; a rule
    written for one tenant would then apply to another. The value must equal itself cast to the column's
    type, compared in the type's base without a modifier (``'ac'`` fits ``character(4)``, ``7`` fits
    ``numeric(5,2)`` and prints ``7.00``)."""
    fits = f"%(t)s::text::{target.tenant_base_type} = %(t)s::text::{target.tenant_type}"
    out = {}
    for tenant in tenants:
        try:
            printed, same = dbapi.fetch_all(
                conn,
                f"SELECT %(t)s::text::{target.tenant_type}::text, "
                + (fits if target.tenant_base_type is not None else "true"),
                {"t": tenant},
            )[0]
        except PermanentError:
            same, printed = False, None
        if not same:
            stored = f": the column would store it as {printed!r}" if printed is not None else ""
            raise PermanentError(
                f"policy {policy.name!r}: field {field_name!r}: tenant {tenant!r} is not a value of column"
                f" {policy.tenant_column!r} ({target.tenant_type}){stored}; nothing was deleted"
            )
        out[tenant] = printed
    return out


def freeze_tenant_cutoffs(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoff: datetime, run_date: datetime | None
) -> TenantCutoffs:
    """The run's per-tenant cutoffs (``tenant_retention``, ``tenant_retention_table``), each its tenant's
    retention before ``run_date``, the run's own date: never a date rebuilt from the cutoff when months
    make that ambiguous (:func:`~airflow_retention.core.planning.cutoff.require_run_date` refuses). A policy
    without per-tenant retention has the run's cutoff alone."""
    if policy.tenant_column is None or not (policy.tenant_retention or policy.tenant_retention_table is not None):
        return TenantCutoffs(cutoff)
    return compute(conn, policy, target, cutoff, require_run_date(policy, cutoff, run_date))
