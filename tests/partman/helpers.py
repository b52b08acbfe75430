"""Driving pg_partman and the purge side by side in a test's own database: partman's calls as its users
make them, the package's planner and chunks as a DAG run would (plan, every chunk, verify), and the rows
a policy keeps computed by the tests' own SQL."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import Plan, plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import ChunkResult, run_chunk
from airflow_retention.core.running.verify import verify_run
from airflow_retention.demo.postgres import admin_execute
from tests.conftest import DSN

# Today's midnight (UTC): partman creates its partitions around the real now(), so the tests' data and
# run dates are laid around it too (every cutoff is in the past, as the planner requires).
TODAY = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
CONDITION = "status <> 'open'"


@dataclass
class Purge:
    """One run of a policy, planned and run to the end like a DAG run."""

    plan: Plan
    cutoff: datetime
    results: list[ChunkResult] = field(default_factory=list)

    @property
    def outcomes(self) -> dict[str, str]:
        return {r.chunk_key: r.outcome for r in self.results}


class Partman:
    """The test database: an autocommit admin connection, partman's calls, and the purge."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.admin = psycopg2.connect(dsn)
        self.admin.autocommit = True

    def close(self) -> None:
        self.admin.close()

    @staticmethod
    def drop_role(name: str) -> None:
        """Drop a role of the test's own (it must own nothing any more: ``DROP OWNED BY`` in its database)."""
        admin_execute(DSN, f'DROP ROLE IF EXISTS "{name}"')

    def q(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        with self.admin.cursor() as cur:
            cur.execute(sql, dict(params or {}))
            return list(cur.fetchall()) if cur.description is not None else []

    def one(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        found = self.q(sql, params)
        assert len(found) == 1, f"expected one row from {sql!r}, got {found}"
        return found[0][0]

    # --- the table and partman's set, as a partman user creates them -------------------------------

    def create_time_set(
        self,
        table: str,
        interval: str,
        *,
        start: datetime,
        premake: int = 4,
        sub_interval: str | None = None,
    ) -> None:
        """``public.<table>`` (id, created_at, status, payload) partitioned by ``created_at`` through
        ``partman.create_parent`` (native), from ``start``; ``sub_interval``: each child sub-partitioned
        through ``partman.create_sub_parent``. partman adds its DEFAULT partitions itself."""
        self.q(
            f"CREATE TABLE public.{table} (id bigserial, created_at timestamptz NOT NULL, status text NOT NULL,"
            " payload text) PARTITION BY RANGE (created_at)"
        )
        self.q(f"CREATE INDEX ON public.{table} (created_at)")
        self.q(
            "SELECT partman.create_parent(%(t)s, 'created_at', 'native', %(i)s, p_premake => %(p)s,"
            " p_start_partition => %(s)s, p_jobmon => false)",
            {"t": f"public.{table}", "i": interval, "p": premake, "s": start.strftime("%Y-%m-%d %H:%M:%S+00")},
        )
        if sub_interval is not None:
            self.q(
                "SELECT partman.create_sub_parent(%(t)s, 'created_at', 'native', %(i)s, p_premake => %(p)s,"
                " p_native_check => 'yes', p_jobmon => false)",
                {"t": f"public.{table}", "i": sub_interval, "p": premake},
            )

    def create_id_set(self, table: str, interval: int, *, premake: int = 4) -> None:
        """``public.<table>`` partitioned by ``id`` (an id-controlled set), ``interval`` ids per child."""
        self.q(
            f"CREATE TABLE public.{table} (id bigint NOT NULL, created_at timestamptz NOT NULL, status text NOT NULL,"
            " payload text) PARTITION BY RANGE (id)"
        )
        self.q(f"CREATE INDEX ON public.{table} (created_at)")
        self.q(
            "SELECT partman.create_parent(%(t)s, 'id', 'native', %(i)s, p_premake => %(p)s, p_jobmon => false)",
            {"t": f"public.{table}", "i": str(interval), "p": premake},
        )

    def fill(self, table: str, start: datetime, end: datetime, step: str = "1 hour", *, ids: bool = False) -> int:
        """One row per ``step`` in [start, end); every 7th hour 'open' (a condition keeps it); ``ids``: ids
        given in time order after the largest one (an id-controlled set). Returns the count."""
        first_id = self.one(f"SELECT coalesce(max(id), 0) FROM public.{table}") if ids else None
        with_status = bool(
            self.q(
                "SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = %(t)s"
                " AND column_name = 'status'",
                {"t": table},
            )
        )
        status = "CASE WHEN mod(extract(epoch FROM g)::bigint / 3600, 7) = 0 THEN 'open' ELSE 'closed' END, "
        self.q(
            f"INSERT INTO public.{table} ({'id, ' if ids else ''}created_at,"
            f" {'status, ' if with_status else ''}payload)"
            f" SELECT {'%(first)s::bigint + row_number() OVER (ORDER BY g), ' if ids else ''}g,"
            f" {status if with_status else ''}md5(g::text)"
            " FROM generate_series(%(s)s::timestamptz, %(e)s::timestamptz - interval '1 microsecond',"
            " %(st)s::interval) g",
            {"s": start, "e": end, "st": step, "first": first_id},
        )
        self.settle(table)
        self.q(f"ANALYZE public.{table}")
        return int(
            self.one(
                f"SELECT count(*) FROM public.{table} WHERE created_at >= %(s)s AND created_at < %(e)s",
                {"s": start, "e": end},
            )
        )

    def settle(self, table: str) -> None:
        """Rows that landed in a DEFAULT partition of the set (a sub-parent has children only around
        now() when partman creates it) moved into children partman creates for them, as partman's docs
        have users do when loading history: ``partition_data_time`` per parent, top first."""
        for (parent,) in self.q(
            "SELECT parent_table FROM partman.part_config WHERE parent_table = %(t)s OR parent_table LIKE %(p)s"
            " ORDER BY length(parent_table), parent_table",
            {"t": f"public.{table}", "p": f"public.{table}\\_p%"},
        ):
            if self.one(f"SELECT count(*) FROM {parent}_default"):
                self.q("SELECT partman.partition_data_time(%(t)s, p_batch_count => 1000)", {"t": parent})

    # --- partman's maintenance ----------------------------------------------------------------------

    def maintain(self, table: str | None = None) -> None:
        """What partman's background worker or cron runs; raises if partman's maintenance fails."""
        if table is None:
            self.q("SELECT partman.run_maintenance(p_jobmon => false)")
        else:
            self.q("SELECT partman.run_maintenance(%(t)s, p_jobmon => false)", {"t": f"public.{table}"})

    def check_default(self) -> dict[str, int]:
        """partman's ``check_default()``: rows in each DEFAULT partition (raises if partman is broken)."""
        return {str(t): int(n) for t, n in self.q("SELECT default_table, count FROM partman.check_default(true)")}

    def part_config(self) -> set[str]:
        return {str(r[0]) for r in self.q("SELECT parent_table FROM partman.part_config")}

    def children(self, table: str) -> list[str]:
        """Every partition of ``public.<table>`` below it (all levels), as schema.name."""
        return [
            str(r[0])
            for r in self.q(
                "SELECT n.nspname || '.' || c.relname FROM pg_partition_tree(%(t)s::regclass) t"
                " JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE t.level > 0 ORDER BY 1",
                {"t": f"public.{table}"},
            )
        ]

    def tables_in(self, schema: str) -> set[str]:
        return {str(r[0]) for r in self.q("SELECT tablename FROM pg_tables WHERE schemaname = %(s)s", {"s": schema})}

    def ids(self, table: str, where: str = "true", params: Mapping[str, Any] | None = None) -> set[int]:
        return {int(r[0]) for r in self.q(f"SELECT id FROM {table} WHERE {where}", params)}

    # --- the purge, as a DAG run does it --------------------------------------------------------------

    def policy(self, table: str, **fields: Any) -> RetentionPolicy:
        data: dict[str, Any] = {
            "name": f"{table}_purge",
            "conn_id": "retention_target",
            "table": f"public.{table}",
            "timestamp_column": "created_at",
            "retention": "10 days",
            "chunk_by": "block",
            "batch_size": 500,
            "target_batch_time": 0,
            "lock_timeout": "5s",
            "statement_timeout": "60s",
        }
        data.update(fields)
        return RetentionPolicy.from_dict(data)

    def plan(self, policy: RetentionPolicy, run_date: datetime = TODAY) -> Purge:
        cutoff = freeze_cutoff(policy, run_date)
        conn = psycopg2.connect(self.dsn)
        try:
            return Purge(plan_run(conn, policy, cutoff, run_date=run_date), cutoff)
        finally:
            conn.close()

    def run(self, policy: RetentionPolicy, purge: Purge) -> Purge:
        """Every chunk of the plan, then the verify step's check: every expected chunk complete."""
        conn = psycopg2.connect(self.dsn)
        try:
            for chunk in purge.plan.chunks:
                purge.results.append(run_chunk(conn, policy, purge.cutoff, chunk))
            verification = verify_run(conn, Ledger(policy.ledger_schema), purge.plan.run_key)
        finally:
            conn.close()
        assert verification.missing == [] and verification.left == [], verification
        return purge

    def purge(self, policy: RetentionPolicy, run_date: datetime = TODAY) -> Purge:
        return self.run(policy, self.plan(policy, run_date))


def days_ago(n: float) -> datetime:
    return TODAY - timedelta(days=n)
