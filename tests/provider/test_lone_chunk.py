"""A lone ``RetentionChunkOperator`` as docs/operators.md shows it, and the run's date carried from the DAG
run to the frozen per-tenant cutoffs, each run by a real Airflow 3 (``dag.test()``) against the real
PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import psycopg2
import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DAGS_FOLDER, E2E_DSN, REPO
from tests.provider.conftest import load_dag, query, task_instances, utc

pytestmark = pytest.mark.airflow

# 2,000 rows with ids 1,000 apart (1,000 to 2,000,000) in a handful of blocks, logged a day apart from
# 2024-01-01: rows before 2025-06-01 (the example's cutoff) are eligible on both sides of id 1,000,000.
AUDIT_SQL = """
DROP SCHEMA IF EXISTS audit CASCADE;
DROP SCHEMA IF EXISTS retention CASCADE;
CREATE SCHEMA audit;
CREATE TABLE audit.audit_log (id bigint PRIMARY KEY, logged_at timestamptz NOT NULL, detail text);
INSERT INTO audit.audit_log
SELECT i * 1000, timestamptz '2024-01-01' + ((i * 7919) % 900) * interval '1 day', 'event ' || i
FROM generate_series(1, 2000) i;
CREATE TABLE audit.audit_log_archive (LIKE audit.audit_log);
ANALYZE audit.audit_log;
"""
CUTOFF = "2025-06-01"


@pytest.fixture
def audit() -> Iterator[Any]:
    conn = psycopg2.connect(E2E_DSN)
    conn.autocommit = True
    query_ = conn.cursor()
    query_.execute(AUDIT_SQL)
    yield conn
    query_.execute("DROP SCHEMA IF EXISTS audit CASCADE; DROP SCHEMA IF EXISTS retention CASCADE")
    conn.close()


def documented_example() -> str:
    """The Python block of docs/operators.md's "Using it alone", as written."""
    text = (REPO / "docs" / "operators.md").read_text()
    section = text[text.index("### Using it alone") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


def ids(conn: Any, where: str) -> set[int]:
    return {r[0] for r in query(conn, f"SELECT id FROM audit.audit_log WHERE {where}")}


def test_the_documented_lone_chunk_purges_the_ids_below_1m(audit: Any) -> None:
    blocks = query(audit, "SELECT pg_relation_size('audit.audit_log') / 8192")[0][0]
    assert blocks < 100  # far fewer blocks than the range's numbers: read as blocks it would take them all
    eligible_low = ids(audit, f"logged_at < '{CUTOFF}' AND id < 1000000")
    eligible_high = ids(audit, f"logged_at < '{CUTOFF}' AND id >= 1000000")
    assert eligible_low and eligible_high
    # The example as a DAG file of its own: Airflow runs DAGs from its dags folder.
    (DAGS_FOLDER / "docs_using_it_alone.py").write_text(documented_example())
    dag_run = load_dag("purge_legacy_range").test(logical_date=utc("2026-01-01"))
    assert dag_run.state == "success"
    assert ids(audit, f"logged_at < '{CUTOFF}'") == eligible_high  # only ids below 1,000,000 were purged
    archived = {r[0] for r in query(audit, "SELECT id FROM audit.audit_log_archive")}
    assert archived == eligible_low
    (ti,) = task_instances(dag_run)
    assert ti.state == "success"


def test_bare_lo_and_hi_are_refused_for_a_lone_chunk() -> None:
    from airflow_retention.operators.retention import RetentionChunkOperator

    policy = RetentionPolicy(
        name="p", conn_id="c", table="t", key_column="id", timestamp_column="ts", retention="30 days"
    )
    with pytest.raises(ValueError, match=r"bare lo/hi are ambiguous") as info:
        RetentionChunkOperator(task_id="lone", policy=policy, lo=10_000, hi=30_000)
    message = str(info.value)
    assert "keys=(lo, hi)" in message and "blocks=(lo, hi)" in message and "'block'" in message
    # Planned chunks keep the planner's lo/hi; a lone one says which range it means.
    assert RetentionChunkOperator(task_id="mapped", policy=policy, lo=0, hi=5, from_plan=True).lo == 0
    assert RetentionChunkOperator(task_id="k", policy=policy, keys=(10_000, 30_000)).chunk_label == "ids [10000, 30000)"
    assert RetentionChunkOperator(task_id="b", policy=policy, blocks=(0, 8)).chunk_label == "blocks [0, 8)"
    with pytest.raises(ValueError, match="has none"):
        blockish = RetentionPolicy(name="q", conn_id="c", table="t", timestamp_column="ts", retention="30 days")
        RetentionChunkOperator(task_id="k", policy=blockish, keys=(0, 10))


@pytest.mark.parametrize(
    ("dag_id", "words"),
    [
        ("lone_blocks_past_the_end", "blocks=(10000, 30000) starts past the end of audit.audit_log, which has"),
        ("lone_keys_past_the_end", "keys=(5000000, 6000000) starts past the largest id of audit.audit_log, 2,000,000"),
    ],
)
def test_a_lone_range_past_the_tables_end_fails_and_deletes_nothing(
    audit: Any, capfd: pytest.CaptureFixture[str], dag_id: str, words: str
) -> None:
    """tests/provider/dags/lone_chunk_dags.py: ``blocks=(10_000, 30_000)`` of a table of a few blocks, and
    ``keys=(5_000_000, 6_000_000)`` above its largest id."""
    before = query(audit, "SELECT count(*) FROM audit.audit_log")[0][0]
    capfd.readouterr()
    dag_run = load_dag(dag_id).test(logical_date=utc("2026-01-01"))
    assert dag_run.state == "failed"
    out = " ".join(capfd.readouterr().out.split())  # Airflow 3.0's console log wraps long exception messages
    assert words in out
    assert query(audit, "SELECT count(*) FROM audit.audit_log")[0][0] == before
    # Refused before its first ledger row: no lone run was recorded.
    assert query(audit, "SELECT count(*) FROM retention.runs")[0][0] == 0


def test_the_plan_task_freezes_tenant_cutoffs_from_the_runs_own_date(target: Any) -> None:
    """A run dated 2026-03-31 keeping "1 month" has the cutoff 02-28, which the runs of 03-28 to 03-31
    share: tenant 2's "7 days" is frozen from the run's own date (03-24), not from a date rebuilt
    from the cutoff (03-21), and the run's ledger row records that date."""
    run_date = utc("2026-03-31")
    dag_run = load_dag("month_end").test(logical_date=run_date)  # tests/provider/dags/lone_chunk_dags.py
    assert dag_run.state == "success"
    ledger = Ledger("airflow_t_ledger")
    (run,) = ledger.recent_runs(target, "t_month_end")
    assert run["cutoff"] == datetime(2026, 2, 28, tzinfo=timezone.utc)
    cutoffs = {t: c for t, _, c, _ in ledger.tenant_cutoffs(target, run["run_key"])}
    assert cutoffs == {"2": datetime(2026, 3, 24, tzinfo=timezone.utc)}
    assert run["run_date"] == run_date
    left = query(target, "SELECT count(*) FROM airflow_t.orders WHERE tenant_id = 2 AND created_at < '2026-03-24'")
    assert left[0][0] == 0
