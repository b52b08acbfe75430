"""Example tables for the four example policies, with a realistic shape: a noisy tenant, rows right
around each run's cutoff, rows held back by the condition, an archive table, a table partitioned by
month and keyed by uuid."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.policy.identifiers import quote_ident
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import MAX_KEY, MIN_KEY, eligibility, target_from

SCHEMA_SQL = """
DROP TABLE IF EXISTS public.webhook_deliveries, public.tenant_events, public.api_requests;
DROP SCHEMA IF EXISTS audit CASCADE;
CREATE TABLE public.webhook_deliveries (
    id              bigserial PRIMARY KEY,
    created_at      timestamptz NOT NULL,
    status          text NOT NULL,
    next_attempt_at timestamptz,
    endpoint        text NOT NULL,
    payload         text NOT NULL
);
CREATE INDEX ON public.webhook_deliveries (created_at);
CREATE TABLE public.tenant_events (
    event_id    bigserial PRIMARY KEY,
    tenant_id   integer NOT NULL,
    occurred_at timestamptz NOT NULL,
    kind        text NOT NULL,
    payload     text NOT NULL
);
CREATE INDEX ON public.tenant_events (occurred_at);
CREATE INDEX ON public.tenant_events (tenant_id, event_id);
CREATE SCHEMA audit;
CREATE TABLE audit.audit_log (
    id        bigserial PRIMARY KEY,
    logged_at timestamptz NOT NULL,
    actor     text NOT NULL,
    action    text NOT NULL,
    detail    text NOT NULL
);
CREATE INDEX ON audit.audit_log (logged_at);
CREATE TABLE audit.audit_log_archive (LIKE audit.audit_log);
CREATE TABLE public.api_requests (
    request_id   uuid NOT NULL DEFAULT gen_random_uuid(),
    requested_at timestamptz NOT NULL,
    route        text NOT NULL,
    status_code  integer NOT NULL,
    PRIMARY KEY (request_id, requested_at)
) PARTITION BY RANGE (requested_at);
CREATE INDEX ON public.api_requests (requested_at);
"""

# Rows spread over `days` days before the anchor, inserted in time order so that keys grow with time as in
# a real table (the planner's key ranges then follow time).
WEBHOOKS_SQL = """
INSERT INTO public.webhook_deliveries (created_at, status, next_attempt_at, endpoint, payload)
SELECT ts,
       CASE WHEN r < 0.70 THEN 'delivered' WHEN r < 0.80 THEN 'abandoned'
            WHEN r < 0.90 THEN 'failed' ELSE 'pending' END,
       CASE WHEN r >= 0.80 OR (r >= 0.78 AND r < 0.80) THEN ts + interval '1 hour' END,
       'https://hooks.example.com/' || (g %% 97),
       repeat(md5(g::text), 4)
FROM (SELECT g, random() AS r,
             %(anchor)s::timestamptz - make_interval(secs => random() * %(days)s::integer * 86400) AS ts
      FROM generate_series(1, %(rows)s::integer) g) s
ORDER BY ts
"""
EVENTS_SQL = """
INSERT INTO public.tenant_events (tenant_id, occurred_at, kind, payload)
SELECT CASE WHEN g %% 69 < 50 THEN 1 ELSE 2 + g %% 69 - 50 END,
       %(anchor)s::timestamptz - make_interval(secs => random() * %(days)s::integer * 86400),
       (ARRAY['view','click','signup','purchase'])[1 + g %% 4],
       repeat(md5(g::text), 3)
FROM generate_series(1, %(rows)s::integer) g ORDER BY 2
"""
AUDIT_SQL = """
INSERT INTO audit.audit_log (logged_at, actor, action, detail)
SELECT %(anchor)s::timestamptz - make_interval(secs => random() * %(days)s::integer * 86400),
       'user' || (g %% 300), (ARRAY['login','update','export','delete'])[1 + g %% 4], repeat(md5(g::text), 2)
FROM generate_series(1, %(rows)s::integer) g ORDER BY 1
"""
API_SQL = """
INSERT INTO public.api_requests (requested_at, route, status_code)
SELECT %(anchor)s::timestamptz - make_interval(secs => random() * %(days)s::integer * 86400),
       '/v1/' || (ARRAY['orders','users','search','health'])[1 + g %% 4], (ARRAY[200,200,200,404,500])[1 + g %% 5]
FROM generate_series(1, %(rows)s::integer) g ORDER BY 1
"""
# Rows one second before, at, and one second after a cutoff: only the first is ever eligible.
EDGE_SQL = {
    "webhook_deliveries": "INSERT INTO public.webhook_deliveries (created_at, status, endpoint, payload)"
    " SELECT %(cutoff)s::timestamptz + make_interval(secs => s), 'delivered', 'edge', 'edge'"
    " FROM unnest(ARRAY[-1, 0, 1]) s",
    "tenant_events": "INSERT INTO public.tenant_events (tenant_id, occurred_at, kind, payload)"
    " SELECT t, %(cutoff)s::timestamptz + make_interval(secs => s), 'edge', 'edge'"
    " FROM unnest(ARRAY[-1, 0, 1]) s, unnest(ARRAY[1, 7]) t",
    "audit_log": "INSERT INTO audit.audit_log (logged_at, actor, action, detail)"
    " SELECT %(cutoff)s::timestamptz + make_interval(secs => s), 'edge', 'edge', 'edge'"
    " FROM unnest(ARRAY[-1, 0, 1]) s",
    "api_requests": "INSERT INTO public.api_requests (requested_at, route, status_code)"
    " SELECT %(cutoff)s::timestamptz + make_interval(secs => s), 'edge', 200 FROM unnest(ARRAY[-1, 0, 1]) s",
}
# The api_requests table covers this many days before the seeding anchor, and a month after it.
API_DAYS = 150


def month_partitions(anchor: datetime) -> list[tuple[str, datetime, datetime]]:
    """Monthly partitions ``api_requests_YYYY_MM`` from the month of ``anchor - API_DAYS`` (minus one, for
    the edge rows of early cutoffs) through the month after the anchor's."""
    first = (anchor - timedelta(days=API_DAYS + 31)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    months = []
    start = first
    while start <= anchor + timedelta(days=31):
        end = (start + timedelta(days=32)).replace(day=1)
        months.append((f"api_requests_{start:%Y_%m}", start, end))
        start = end
    return months


@dataclass(frozen=True)
class Shape:
    webhooks: int = 60_000
    events: int = 150_000
    audit: int = 30_000
    api: int = 60_000


def seed_examples(conn: Any, anchor: datetime, cutoffs: dict[str, Iterable[datetime]], shape: Shape = Shape()) -> None:
    """(Re)create and fill the example tables. ``cutoffs`` maps policy name to the cutoffs the runs will
    use, so that rows sit right on both sides of each."""
    with dbapi.transaction(conn) as cur:
        cur.execute(SCHEMA_SQL)
        cur.execute(WEBHOOKS_SQL, {"anchor": anchor, "days": 60, "rows": shape.webhooks})
        cur.execute(EVENTS_SQL, {"anchor": anchor, "days": 120, "rows": shape.events})
        cur.execute(AUDIT_SQL, {"anchor": anchor, "days": 420, "rows": shape.audit})
        for name, start, end in month_partitions(anchor):
            cur.execute(
                f"CREATE TABLE public.{name} PARTITION OF public.api_requests"
                " FOR VALUES FROM (%(start)s::timestamptz) TO (%(end)s::timestamptz)",
                {"start": start, "end": end},
            )
        cur.execute(API_SQL, {"anchor": anchor, "days": API_DAYS, "rows": shape.api})
        for name, values in cutoffs.items():
            for cutoff in values:
                cur.execute(EDGE_SQL[name], {"cutoff": cutoff})
        cur.execute(
            "ANALYZE public.webhook_deliveries; ANALYZE public.tenant_events; ANALYZE audit.audit_log;"
            " ANALYZE public.api_requests"
        )


@dataclass(frozen=True)
class Snapshot:
    """The rows a purge at ``cutoff`` must leave: their count and an order-free checksum of their keys."""

    table: str
    total: int
    eligible: int
    keep_count: int
    keep_checksum: int


def snapshot(conn: Any, policy: RetentionPolicy, cutoff: datetime) -> Snapshot:
    """Count the table and the rows eligible at ``cutoff``; checksum the rows to keep (whole rows: a
    table need not have a key)."""
    target = inspect_target(conn, policy)
    where = eligibility(policy, target, tenant_filter=False, key_range=policy.chunk_by == "key")
    params = {"cutoff": cutoff, "lo": MIN_KEY, "hi": MAX_KEY}
    # The target under the alias the engine gives it, so that the condition reads the same rows.
    table, row = target_from(policy), quote_ident(policy.table.name)
    eligible = dbapi.fetch_all(conn, f"SELECT count(*) FROM {table} WHERE {where}", params)[0][0]
    keep = dbapi.fetch_all(
        conn,
        f"SELECT count(*), coalesce(sum(hashtextextended(ROW({row}.*)::text, 0)::numeric), 0)"
        f" FROM {table} WHERE NOT coalesce(({where}), false)",
        params,
    )[0]
    total = dbapi.fetch_all(conn, f"SELECT count(*) FROM {policy.table.sql}")[0][0]
    return Snapshot(str(policy.table), int(total), int(eligible), int(keep[0]), int(keep[1]))


def utc_day(value: str) -> datetime:
    """Midnight UTC of an ISO date."""
    return datetime.fromisoformat(value).replace(tzinfo=timezone.utc)
