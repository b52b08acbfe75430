"""One eligibility predicate, and the ways a statement names its target and bounds its rows.

Every statement that reads or deletes a policy's rows is built from :func:`eligibility`: the batch
statements, the planner's samples and counts, the verification's leftovers check and the partition
checks. Identifiers are quoted by :mod:`..policy.identifiers`; values travel as parameters with explicit
casts; the policy's ``condition`` (trusted SQL) is wrapped in parentheses on lines of its own. Every
statement names the target through :func:`target_from`, under the alias of the policy table's own
name, so that the condition's ``events.col`` is the row at hand on the table and on each leaf.
"""

from __future__ import annotations

from airflow_retention.core.policy.identifiers import TableName, quote_ident
from airflow_retention.core.policy.model import RetentionPolicy, has_per_tenant_rules
from airflow_retention.core.sql.target import TargetInfo

# The whole key space, for statements that are not limited to a chunk. Not -2**63: psycopg2 sends
# -9223372036854775808::bigint, which overflows before the negation.
MIN_KEY = -(2**63) + 1
MAX_KEY = 2**63 - 1


def target_from(policy: RetentionPolicy, relation: TableName | None = None) -> str:
    """The target of a statement that reads or deletes the policy's rows: the table (or ``relation``, a
    leaf partition) under the alias of the policy table's unqualified name (``"public"."events_p3" AS
    "events"``). A ``condition`` may then write ``events.col`` for the row being deleted: a correlated
    subquery binds to it, on a plain table and on every leaf alike (a leaf's own name would be unknown
    to the condition). The one place the alias is made: every statement here goes through it."""
    return f"{(relation or policy.table).sql} AS {quote_ident(policy.table.name)}"


def eligibility(
    policy: RetentionPolicy,
    target: TargetInfo,
    *,
    tenant_filter: bool,
    null_tenants: bool = False,
    key_range: bool = True,
) -> str:
    """The predicate of an eligible row in the range ``[%(lo)s, %(hi)s)``, optionally of one tenant.

    Parameters: ``lo``, ``hi`` (bigint), ``cutoff`` (timestamptz), ``tenant`` (text) when filtered.
    A ``timestamp without time zone`` column is read as UTC. In a policy with a tenant column, a row
    whose tenant is NULL belongs to no tenant and is never eligible (``null_tenants`` lets the planner
    count them, to warn). ``key_range=False`` leaves out the range (block chunks bound rows by ``ctid``).
    """
    ts = quote_ident(policy.timestamp_column)
    parts = []
    if key_range:
        key = key_column(policy)
        parts += [f"{key} >= %(lo)s::bigint", f"{key} < %(hi)s::bigint"]
    if has_per_tenant_rules(policy):
        parts += _per_tenant(policy, target)
    else:
        parts.append(f"{ts} < {cutoff_value(target)}")
    if tenant_filter:
        parts.append(one_tenant(policy, target))
    elif policy.tenant_column is not None and not null_tenants:
        parts.append(f"{quote_ident(policy.tenant_column)} IS NOT NULL")
    if policy.condition:
        # Statements built here always travel with parameters: a literal % (LIKE 'a%') must be doubled.
        parts.append(f"(\n{policy.condition.replace('%', '%%')}\n)")
    return "\n  AND ".join(parts)


def cutoff_value(target: TargetInfo, value: str = "%(cutoff)s::timestamptz") -> str:
    """The ``%(cutoff)s`` parameter (or another timestamptz expression) as a value of the timestamp
    column's type (a naive column is UTC)."""
    return value if target.timestamp_has_tz else f"({value} AT TIME ZONE 'UTC')"


def _per_tenant(policy: RetentionPolicy, target: TargetInfo) -> list[str]:
    """Each row against its own tenant's frozen cutoff (``%(ot)s`` tenants, ``%(oc)s`` their cutoffs,
    ``%(cutoff)s`` for every other tenant), bounded by ``%(latest_cutoff)s`` so that an index on the
    timestamp still serves; tenants in ``%(xt)s`` (at their ``max_rows_per_tenant``) are left out.
    Parameters from :meth:`airflow_retention.core.planning.tenants.TenantCutoffs.params`."""
    ts = quote_ident(policy.timestamp_column)
    tenant = quote_ident(str(policy.tenant_column))
    # The tenant lists are cast once to the column's type (folded by the server), so that each row is
    # compared as it is stored instead of paying a text cast of its tenant. Each frozen tenant is the
    # only one of the run's overrides equal to it as the column compares (tenants._resolve), so the
    # first position array_position finds is the row's own cutoff.
    return [
        f"{ts} < {cutoff_value(target, '%(latest_cutoff)s::timestamptz')}",
        f"{ts} < {cutoff_value(target, _own_cutoff(target, tenant))}",
        f"(cardinality(%(xt)s::text[]) = 0 OR {tenant} <> ALL({tenant_values(target, '%(xt)s')}))",
    ]


def _own_cutoff(target: TargetInfo, tenant: str) -> str:
    """The frozen cutoff of the tenant ``tenant`` (a column or a typed value), or the run's."""
    own = f"(%(oc)s::timestamptz[])[array_position({tenant_values(target, '%(ot)s')}, {tenant})]"
    return f"coalesce({own}, %(cutoff)s::timestamptz)"


def tenant_cutoff(target: TargetInfo, param: str) -> str:
    """The frozen cutoff of the tenant in the text parameter ``param``, found as every statement finds a
    row's (:func:`_per_tenant`): equal as the column compares tenants."""
    return _own_cutoff(target, tenant_value(target, param))


def tenant_values(target: TargetInfo, param: str) -> str:
    """A text[] parameter as an array of the tenant column's type and collation: compared with the
    column, its elements are equal to a row's tenant exactly when the column says so (``citext``, a
    case-insensitive collation, ``numeric`` scales). The type carries its modifier (character(4), not
    character, which is char(1) and would cut 'acme' to 'a'); every value was checked to fit it
    unchanged when the run was planned (tenants.as_printed)."""
    if not target.tenant_type:
        return f"{param}::text[]"
    return f"{param}::text[]::{target.tenant_type}[]{_collate(target)}"


def tenant_value(target: TargetInfo, expr: str) -> str:
    """A text expression as a value of the tenant column's type and collation (see :func:`tenant_values`)."""
    return f"{expr}::text::{target.tenant_type}{_collate(target)}"


def _collate(target: TargetInfo) -> str:
    # Explicit, so that a domain's or a type's own collation can never decide instead of the column's.
    return f" COLLATE {target.tenant_collation}" if target.tenant_collation else ""


def key_column(policy: RetentionPolicy) -> str:
    if policy.key_column is None:
        raise ValueError(f"policy {policy.name!r} has no key_column; key ranges need one")
    return quote_ident(policy.key_column)


def one_tenant(policy: RetentionPolicy, target: TargetInfo) -> str:
    # One tenant at a time: "= value" lets the (tenant, key) index return keys in order.
    if policy.tenant_column is None or target.tenant_type is None:
        raise ValueError("a tenant filter needs a tenant column")
    return f"{quote_ident(policy.tenant_column)} = {tenant_value(target, '%(tenant)s')}"


def in_blocks(pred: str) -> str:
    return "ctid >= %(lo_tid)s::tid AND ctid < %(hi_tid)s::tid\n  AND " + pred


def tenant_choice(tenant: str, target: TargetInfo) -> str:
    """One-pass statements: only the ``%(only)s`` tenants (NULL: all), never the ``%(skip)s`` ones (the
    chunk's dead letters: their rows failed, and are left), compared as the column compares tenants."""
    # Written so that the server folds each test away when its list is NULL or empty (the usual
    # batch), and with the lists cast to the column's type, so that no row pays a text cast of its tenant.
    return (
        f"\n  AND (%(only)s::text[] IS NULL OR {tenant} = ANY({tenant_values(target, '%(only)s')}))"
        f"\n  AND (cardinality(%(skip)s::text[]) = 0 OR {tenant} <> ALL({tenant_values(target, '%(skip)s')}))"
    )


def condition_probe(policy: RetentionPolicy) -> str:
    """A statement that makes the server parse and plan the condition without reading a row; it is run
    without parameters, so the condition goes in as written; the target has the alias of every other
    statement (:func:`target_from`)."""
    return f"EXPLAIN SELECT 1 FROM {target_from(policy)} WHERE (\n{policy.condition}\n)"
