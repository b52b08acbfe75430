"""A throwaway database holding every table the docs' examples name, filled like the demo's (small), and
the run date the examples are planned for."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2
import pytest

from airflow_retention.demo.seed import Shape, seed_examples
from tests.conftest import throwaway_database

# The examples' run date: yesterday's midnight (UTC), so that no cutoff is in the future.
RUN_DATE = (datetime.now(timezone.utc) - timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
SHAPE = Shape(webhooks=3_000, events=6_000, audit=3_000, api=3_000)
# The tables the examples name beyond the demo's four (README: public.events; policies.md: public.sessions).
EXTRA_TABLES = """
CREATE TABLE public.events (
    id          bigserial PRIMARY KEY,
    tenant_id   integer NOT NULL,
    occurred_at timestamptz NOT NULL,
    payload     text NOT NULL
);
CREATE INDEX ON public.events (occurred_at);
INSERT INTO public.events (tenant_id, occurred_at, payload)
SELECT 1 + g %% 5, %(anchor)s::timestamptz - g * interval '1 hour', md5(g::text) FROM generate_series(1, 4000) g;
CREATE TABLE public.sessions (
    id           bigserial PRIMARY KEY,
    last_seen_at timestamptz NOT NULL
);
CREATE INDEX ON public.sessions (last_seen_at);
INSERT INTO public.sessions (last_seen_at)
SELECT %(anchor)s::timestamptz - g * interval '10 minutes' FROM generate_series(1, 4000) g;
ANALYZE public.events;
ANALYZE public.sessions;
"""


def seed(dsn: str) -> None:
    """Create and fill the example tables in the database of ``dsn``."""
    conn = psycopg2.connect(dsn)
    try:
        seed_examples(conn, RUN_DATE, {}, SHAPE)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(EXTRA_TABLES, {"anchor": RUN_DATE})
    finally:
        conn.close()


@pytest.fixture(scope="module")
def example_dsn() -> Iterator[str]:
    """A database of its own with the example tables, per test module (the examples only read and plan;
    the ledger they may create is theirs), dropped afterwards."""
    with throwaway_database("retention_docs") as dsn:
        seed(dsn)
        yield dsn


def admin_connection(dsn: str) -> Any:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    return conn
