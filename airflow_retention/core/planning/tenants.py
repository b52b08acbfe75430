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
from airflow_retention.core.policy.identifiers import quote_ident
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules
from airflow_retention.core.sql.predicate import tenant_value
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


@dataclass(frozen=True)
class _Entry:
    """One tenant's retention as a source gives it: ``tenant`` as the column prints it."""

    tenant: str
    retention: str
    cutoff: datetime
    source: str  # "policy" (tenant_retention) or "table" (tenant_retention_table)


def compute(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoff: datetime, anchor: datetime
) -> TenantCutoffs:
    """The overrides of a run whose date is ``anchor``: the lookup table's, then the policy's map over it.
    Raises :class:`PermanentError` naming the field for a tenant value the column cannot hold, a lookup
    table without its columns, or a retention that is not positive; nothing is written.

    Entries name one tenant when the column compares them equal, not when they print alike: ``acme``
    and ``ACME`` of a ``citext`` column or of a case-insensitive collation, ``7`` and ``7.0`` of a
    ``numeric``. Among such entries of one source the longest retention wins (it keeps the most rows);
    the policy's map wins over the table (:func:`_resolve`)."""
    entries: list[_Entry] = []
    if policy.tenant_retention_table is not None:
        table = _read_table(conn, policy, target)
        canonical = as_printed(conn, policy, target, [t for t, _ in table], "tenant_retention_table")
        cutoffs = _table_cutoffs(conn, anchor, [r for _, r in table])
        entries += [_Entry(canonical[t], r, c, "table") for (t, r), c in zip(table, cutoffs, strict=True)]
    if policy.tenant_retention:
        canonical = as_printed(conn, policy, target, [t for t, _ in policy.tenant_retention], "tenant_retention")
        for tenant, retention in policy.tenant_retention:
            moment = retention.before(anchor)
            at = datetime.fromtimestamp(moment.timestamp(), tz=timezone.utc)
            entries.append(_Entry(canonical[tenant], str(retention), at, "policy"))
    if not entries:
        return TenantCutoffs(cutoff)
    overrides = sorted((e.tenant, e.retention, e.cutoff, e.source) for e in _resolve(conn, policy, target, entries))
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


def _resolve(conn: Any, policy: RetentionPolicy, target: TargetInfo, entries: list[_Entry]) -> list[_Entry]:
    """One entry per tenant, tenants being equal as the column compares them (the server groups the
    values by the column's type and collation: the equality every statement's ``array_position`` then
    applies to a row). Within a group the policy's entries win over the table's; among those, the
    longest retention (the earliest cutoff; an exact tie, the first in text order, the same on every
    run). A tenant named more than once by one source is logged with its retentions: remove the
    duplicates."""
    chosen = []
    for group in _equal_groups(conn, target, [e.tenant for e in entries]):
        members = [entries[i] for i in group]
        source = "policy" if any(m.source == "policy" for m in members) else "table"
        rivals = [m for m in members if m.source == source]
        best = min(rivals, key=lambda m: (m.cutoff, m.retention))
        chosen.append(best)
        if len(rivals) > 1:
            spellings = sorted({m.tenant for m in rivals})
            where = (
                f"tenant_retention_table {policy.tenant_retention_table}" if source == "table" else "tenant_retention"
            )
            log.warning(
                "policy %s: %s lists tenant %r %d times (retention %s)%s: the longest, %s, applies (it keeps the"
                " most rows); remove the duplicates",
                policy.name,
                where,
                best.tenant,
                len(rivals),
                ", ".join(sorted(m.retention for m in rivals)),
                f"; written {', '.join(map(repr, spellings))}, one value of column {policy.tenant_column!r}"
                f" ({target.tenant_type})"
                if len(spellings) > 1
                else "",
                best.retention,
            )
    return chosen


def _equal_groups(conn: Any, target: TargetInfo, values: list[str]) -> list[list[int]]:
    """The indexes of ``values`` grouped by equality as the tenant column compares them: its type
    (``citext``, ``numeric``: ``7`` = ``7.0``) and its collation (a nondeterministic one:
    ``acme`` = ``ACME``), in the order of each group's first value."""
    rows = dbapi.fetch_all(
        conn,
        f"SELECT array_agg(i::integer - 1 ORDER BY i) FROM unnest(%(t)s::text[]) WITH ORDINALITY AS x(t, i)"
        f" GROUP BY {tenant_value(target, 'x.t')} ORDER BY min(i)",
        {"t": values},
    )
    return [list(r[0]) for r in rows]


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


def _table_cutoffs(conn: Any, anchor: datetime, retentions: list[str]) -> list[datetime]:
    """``anchor - interval`` in UTC for each retention, by the server (calendar-aware, as for ``retention``)."""
    found = dbapi.fetch_all(
        conn,
        "SELECT ((%(a)s::timestamptz AT TIME ZONE 'UTC') - r::interval) AT TIME ZONE 'UTC'"
        " FROM unnest(%(r)s::text[]) WITH ORDINALITY AS x(r, i) ORDER BY i",
        {"a": anchor, "r": retentions},
    )
    return [c for (c,) in found]


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
