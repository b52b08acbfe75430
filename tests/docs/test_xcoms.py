"""The values docs/operators.md shows, against what the code gives: ``task_defaults(policy)``, and the
planner's two XComs as a real run pushes them (``dag.test()`` of the example ``tenant_events`` policy's DAG
against the example tables). The documented blocks are read from the Markdown, evaluated (``...`` stands
for more of the same), and their keys compared with the real ones."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.postgres import airflow_connection_json
from tests.conftest import DAGS_FOLDER
from tests.provider.conftest import xcom_values

from .conftest import RUN_DATE
from .markdown import REPO, Block, blocks

OPERATORS = REPO / "docs" / "operators.md"
POLICIES = REPO / "dags" / "retention_policies.yaml"
BASE = {
    "name": "documented",
    "conn_id": "retention_target",
    "table": "public.webhook_deliveries",
    "timestamp_column": "created_at",
    "retention": "30 days",
}


def documented(*needles: str) -> tuple[Block, Any]:
    """The one Python value block of docs/operators.md holding every needle, and its value."""
    found = [b for b in blocks("python", files=[OPERATORS]) if all(n in b.text for n in needles)]
    assert len(found) == 1, f"docs/operators.md: {len(found)} python blocks hold {needles}"
    policy = RetentionPolicy.from_dict({**BASE, "queue": "retention"})
    return found[0], eval(compile(found[0].text, found[0].where, "eval"), {"policy": policy, "timedelta": timedelta})


@pytest.fixture(scope="module")
def airflow_metadata() -> None:
    """The throwaway Airflow home's metadata database, migrated (dag.test() records its run there)."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, stdout=subprocess.DEVNULL)


@pytest.mark.airflow
def test_task_defaults_are_as_documented() -> None:
    from airflow_retention.dag_factory import task_defaults

    block, value = documented("retry_exponential_backoff")
    policy = RetentionPolicy.from_dict(
        {"name": "documented", "conn_id": "c", "table": "t", "timestamp_column": "c", "retention": "1 day"}
    )
    queued = RetentionPolicy.from_dict({**BASE, "queue": "retention"})
    # Evaluated with a policy that sets queue (the documented "queue" line is there only then).
    assert value == task_defaults(queued), f"{block.where}: task_defaults(policy) is {task_defaults(queued)}"
    assert "queue" not in task_defaults(policy)


@pytest.mark.airflow
def test_the_planners_xcoms_are_as_documented(
    airflow_metadata: None, example_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_retention.compat import dagbag

    monkeypatch.setenv("AIRFLOW_CONN_RETENTION_TARGET", airflow_connection_json(example_dsn))
    policy = next(p for p in load_policies(POLICIES) if p.name == "tenant_events")
    # The example DAG file and policies, as the test suite's Airflow home holds them (tests/conftest.py).
    bag = dagbag(str(DAGS_FOLDER))
    assert not bag.import_errors, bag.import_errors
    dag_run = bag.dags[f"retention_{policy.name}"].test(logical_date=RUN_DATE)
    assert dag_run.state == "success"
    plan_task = f"retention_{policy.name}.plan"
    (chunks,) = xcom_values(dag_run, plan_task, "return_value")
    (run,) = xcom_values(dag_run, plan_task, "run")
    assert chunks and run["chunk_keys"] == [c["chunk_key"] for c in chunks]

    block, items = documented('"chunk_key"', '"rows_planned"', "...,")
    assert items[-1] is Ellipsis
    assert set(items[0]) == set(chunks[0]), f"{block.where}: a chunk's XCom has keys {sorted(chunks[0])}"
    block, summary = documented('"chunk_keys"', '"planning_seconds"')
    assert set(summary) == set(run), f"{block.where}: the run XCom has keys {sorted(run)}"


def test_a_partition_chunk_carries_the_documented_keys(example_dsn: str) -> None:
    """docs/operators.md: a chunk of a partitioned table adds partition, partition_oid and action."""
    text = OPERATORS.read_text()
    assert '`"partition"`' in text and '`"partition_oid"`' in text and '`"action"`' in text
    policy = next(p for p in load_policies(POLICIES) if p.name == "api_requests")
    conn = psycopg2.connect(example_dsn)
    try:
        plan = plan_run(conn, policy, freeze_cutoff(policy, RUN_DATE), run_date=RUN_DATE)
    finally:
        conn.close()
    kinds = {item.get("action") for item in plan.expand_kwargs()}
    assert "drop" in kinds and kinds <= {"drop", None}, kinds  # expired months (and a straddling one's blocks)
    for item in plan.expand_kwargs():
        assert {"partition", "partition_oid", "action"} <= set(item)
