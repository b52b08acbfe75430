"""Where the tests and the demo find PostgreSQL: the DSN given, the local server, or a throwaway one."""

from __future__ import annotations

import psycopg2
import pytest

from airflow_retention.demo import postgres


def test_a_throwaway_server_starts_when_no_server_answers() -> None:
    dsn = postgres.start_embedded()
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('server_version_num')::int")
            assert cur.fetchone()[0] >= 120000
    finally:
        conn.close()
    assert postgres.start_embedded() == dsn  # one per process


def test_an_explicit_dsn_that_does_not_answer_is_an_error_not_a_fallback() -> None:
    with pytest.raises(RuntimeError, match="does not answer"):
        postgres.resolve_dsn("postgresql://nobody@127.0.0.1:1/none")


def test_the_airflow_connection_keeps_a_unix_socket_host() -> None:
    import json

    conn = json.loads(postgres.airflow_connection_json("postgresql://postgres:@/postgres?host=/tmp/pg-sock"))
    assert conn["host"] == "/tmp/pg-sock" and conn["schema"] == "postgres" and conn["conn_type"] == "postgres"
