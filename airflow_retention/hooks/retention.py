"""``RetentionHook``: a ``PostgresHook`` that runs the retention core on its connection."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from airflow.providers.postgres.hooks.postgres import PostgresHook

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec
from airflow_retention.core.planning.cutoff import run_key as key_of_run
from airflow_retention.core.planning.planner import Plan, plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import BatchReport, ChunkResult, run_chunk
from airflow_retention.core.running.verify import (
    Leftovers,
    Verification,
    measure_leftovers,
    measure_pending_lag,
    vacuum_table,
    verify_run,
)
from airflow_retention.hooks.metadata_server import ignoring_metadata


class RetentionHook(PostgresHook):
    """Plan, purge and verify the runs of one policy over its Postgres connection.

    Works with the psycopg 3 connections of ``apache-airflow-providers-postgres`` on Airflow 3.2+ and the
    psycopg2 ones before; every call opens its own connection and closes it.

    :param policy: the retention policy; its ``conn_id`` names the connection.
    """

    hook_name = "Retention"

    def __init__(self, *, policy: RetentionPolicy, **kwargs: Any) -> None:
        kwargs.setdefault("postgres_conn_id", policy.conn_id)
        super().__init__(**kwargs)
        self.policy = policy
        self.ledger = Ledger(policy.ledger_schema)

    @contextmanager
    def open_connection(self) -> Iterator[Any]:
        conn = self.get_conn()
        try:
            yield conn
        finally:
            conn.close()

    def plan(
        self, cutoff: datetime, *, max_chunks: int, planned_by: str | None = None, run_date: datetime | None = None
    ) -> Plan:
        with self.open_connection() as conn:
            try:
                return plan_run(
                    conn, self.policy, cutoff, max_chunks=max_chunks, planned_by=planned_by, run_date=run_date
                )
            except Exception as exc:
                # No run row records a failed plan: the ledger's plan_failures does, for `status` and the view.
                self.ledger.record_plan_failure(
                    conn, self.policy.name, key_of_run(self.policy, cutoff), cutoff, str(exc), planned_by
                )
                raise

    def run_chunk(
        self,
        cutoff: datetime,
        chunk: ChunkSpec,
        attempt: Attempt,
        *,
        lone: bool = False,
        on_batch: Callable[[BatchReport], None] | None = None,
        run_date: datetime | None = None,
        policy: RetentionPolicy | None = None,
    ) -> ChunkResult:
        """Purge one chunk; ``policy`` overrides the hook's for this chunk (a lone key range of a policy
        that chunks by blocks runs it with ``chunk_by: key``)."""
        target = self.connection  # as get_conn reads it
        # An Airflow Postgres connection's schema is its database (the hook's ``database`` overrides it).
        database = self.database or target.schema
        policy = ignoring_metadata(policy or self.policy, target.host, target.port, database)
        with self.open_connection() as conn:
            return run_chunk(
                conn,
                policy,
                cutoff,
                chunk,
                attempt=attempt,
                lone=lone,
                on_batch=on_batch,
                run_date=run_date,
            )

    def verify(self, run_key: str, expected_keys: Sequence[str] | None = None) -> Verification:
        with self.open_connection() as conn:
            return verify_run(conn, self.ledger, run_key, expected_keys)

    def complete_run(self, run_key: str, verified_by: str | None) -> dict[str, Any]:
        with self.open_connection() as conn:
            return self.ledger.complete_run(conn, run_key, verified_by)

    def measure_leftovers(self, run_key: str, cutoff: datetime, *, timeout_ms: int | None = None) -> Leftovers:
        """The run's cleanup lag over its lag window, recorded on its ledger row."""
        with self.open_connection() as conn:
            return measure_leftovers(
                conn, self.policy, cutoff, ledger=self.ledger, run_key=run_key, windowed=True, timeout_ms=timeout_ms
            )

    def measure_pending_lag(self) -> tuple[dict[str, Any], Leftovers] | None:
        """The cleanup lag of the policy's latest complete run, when its verify left it to later."""
        with self.open_connection() as conn:
            return measure_pending_lag(conn, self.policy, self.ledger)

    def vacuum(self, run_key: str) -> None:
        with self.open_connection() as conn:
            vacuum_table(conn, self.policy)
            self.ledger.record_vacuum(conn, run_key)

    def get_run(self, run_key: str) -> dict[str, Any] | None:
        with self.open_connection() as conn:
            return self.ledger.get_run(conn, run_key)

    def ensure_ledger(self) -> int:
        with self.open_connection() as conn:
            return self.ledger.ensure(conn)
