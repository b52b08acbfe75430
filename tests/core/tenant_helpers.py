"""Tables, policies and checks shared by the tenant tests (tests/core/planning/test_tenants.py) and the tenant
drills (tests/drills/test_tenant_drills.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk

from .helpers import CUTOFF, create_events, fill_events, make_policy, rows

REPO = Path(__file__).resolve().parents[2]
ANCHOR = CUTOFF.replace(month=7)  # the policy keeps 30 days: CUTOFF is 30 days before 2024-07-01 12:00
# 8 tenants interleaved row by row, timestamps over 100 days before the anchor, every 7th row open.
CREATED = "%(cutoff)s::timestamptz + (mod(g * 37, 100) - 70) * interval '1 day'"


def interleaved(admin: Any, schema: str, count: int = 8_000) -> str:
    table = create_events(admin, schema)
    fill_events(admin, table, count, tenant="1 + mod(g, 8)", created=CREATED)
    return table


def one_pass(schema: str, **overrides: Any) -> RetentionPolicy:
    data = {"chunk_by": "block", "tenant_column": "tenant_id", "batch_size": 500, "chunk_rows": 2_000, **overrides}
    return make_policy(schema, **data)


def per_tenant_eligible(admin: Any, table: str, cutoffs: dict[str, Any] | None = None) -> dict[str, int]:
    """Eligible rows per tenant, by the tests' own SQL: each tenant against its own cutoff."""
    found = rows(
        admin,
        f"SELECT tenant_id::text, created_at FROM {table} WHERE status <> 'open'",
    )
    counts: dict[str, int] = {}
    for tenant, created in found:
        if created < (cutoffs or {}).get(tenant, CUTOFF):
            counts[tenant] = counts.get(tenant, 0) + 1
    return counts


def ledger_tenant_counts(admin: Any, ledger: str, run_key: str) -> dict[str, int]:
    return dict(
        rows(
            admin,
            f'SELECT tenant, sum(rows_deleted)::bigint FROM "{ledger}".tenant_counts WHERE run_key = %(k)s GROUP BY 1',
            {"k": run_key},
        )
    )


def reference_expired_rows(admin: Any, schema: str, table: str, tenant: int = 3, count: int = 5) -> None:
    """Orders that reference ``count`` of ``tenant``'s expired rows (the last by id): deleting those rows
    violates a foreign key, so the tenant becomes a dead letter until ``DELETE FROM orders``."""
    rows(admin, f'CREATE TABLE "{schema}".orders (event_id bigint REFERENCES {table} (id))')
    rows(
        admin,
        f'INSERT INTO "{schema}".orders SELECT id FROM {table} WHERE tenant_id = %(t)s AND status <> %(s)s'
        " AND created_at < %(c)s ORDER BY id DESC LIMIT %(n)s",
        {"t": tenant, "s": "open", "c": CUTOFF, "n": count},
    )


def purge(conn: Any, policy: RetentionPolicy, **plan_kwargs: Any) -> Any:
    plan = plan_run(conn, policy, CUTOFF, **plan_kwargs)
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    return plan


WORKER_APPLICATION = "retention-drill-worker"  # how a test finds its workers in pg_stat_activity
# A worker process running one chunk: it pauses after each committed batch (so that a test can kill
# it between batches), or SIGKILLs itself right after its first commit ("die_after_commit").
CHILD = r"""
import json, logging, os, signal, sys, time
from datetime import datetime
import psycopg, psycopg2
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.policy.model import RetentionPolicy

args = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")  # to the test's file
connect = psycopg.connect if args["driver"] == "psycopg" else psycopg2.connect
conn = connect(args["dsn"], application_name=args["application_name"])

def after_commit(report):
    if args.get("die_after_commit"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(args.get("pause", 0.3))

run_chunk(conn, RetentionPolicy.from_dict(args["policy"]), datetime.fromisoformat(args["cutoff"]),
          ChunkSpec(**args["chunk"]), on_batch=after_commit, lone=args.get("lone", False))
"""


def start_worker(
    driver: str, dsn: str, policy: RetentionPolicy, chunk: ChunkSpec, stderr: IO[str], **options: Any
) -> subprocess.Popen[bytes]:
    """:data:`CHILD` in a process of its own, on ``chunk``."""
    args = {
        "driver": driver,
        "dsn": dsn,
        "policy": policy_to_dict(policy),
        "cutoff": CUTOFF.isoformat(),
        "chunk": {"key": chunk.key, "lo": chunk.lo, "hi": chunk.hi, "seq": chunk.seq},
        "application_name": WORKER_APPLICATION,
        **options,
    }
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, stderr=stderr)
