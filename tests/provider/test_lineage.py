"""Issue 33: the OpenLineage facets of the plan and chunk tasks, with the real OpenLineage provider and without it.

A run of ``t_audit_asset`` (tests/provider/dags/asset_dags.py) by a real Airflow 3 (``dag.test()``) in a
process of its own, whose OpenLineage provider writes its events to a file (``[openlineage] transport``,
type ``file``): the events are read back and checked. A process of its own, because the provider decides
at its first use whether it is enabled (no transport: disabled) and this test session's other runs must
not emit. The same process first checks that importing the package and building its DAGs loads nothing of
OpenLineage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DAGS_FOLDER, E2E_DB
from tests.provider.dag_sync import sync_test_dags

pytestmark = pytest.mark.airflow

RUN = textwrap.dedent(
    """
    import json, sys
    from datetime import datetime, timezone

    import airflow_retention.dag_factory, airflow_retention.lineage, airflow_retention.operators.retention

    def loaded():
        return sorted(m for m in sys.modules if m.split(".")[0] == "openlineage" or m.startswith(
            ("airflow.providers.openlineage.extractors", "airflow.providers.openlineage.plugins",
             "airflow.providers.common.compat.openlineage")))

    print("LOADED-AT-IMPORT " + json.dumps(loaded()))
    from airflow_retention.compat import dagbag

    bag = dagbag(sys.argv[1])
    print("LOADED-AFTER-PARSE " + json.dumps(loaded()))
    run = bag.dags["retention_t_audit_asset"].test(logical_date=datetime(2026, 1, 25, tzinfo=timezone.utc))
    print("STATE " + str(run.state))
    """
)


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_run_reports_its_table_sql_and_rows(target: Any, tmp_path: Path) -> None:
    pytest.importorskip("airflow.providers.openlineage")
    from airflow.sdk import Connection

    log_file = tmp_path / "openlineage.jsonl"
    env = {
        **os.environ,
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(log_file), "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "retention-tests",
    }
    sync_test_dags()  # Airflow 3.0's dag.test() does not: the verify task's asset must be active
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(DAGS_FOLDER)], env=env, capture_output=True, text=True, timeout=300
    )
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    assert done.returncode == 0 and said.get("STATE") == "success", done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(said["LOADED-AT-IMPORT"]) == []  # nothing of OpenLineage at the package's import
    assert json.loads(said["LOADED-AFTER-PARSE"]) == []  # nor when its DAGs are built

    conn = Connection.get("retention_target")
    namespace, name = f"postgres://{conn.host}:{conn.port}", f"{E2E_DB}.airflow_t.audit"
    run = Ledger("airflow_t_ledger").get_run(target, "t_audit_asset@2026-01-15T00:00:00Z")
    assert run is not None and run["state"] == "complete" and run["rows_deleted"] > 0
    complete = {}
    for event in events_of(log_file):
        if event["eventType"] == "COMPLETE":
            complete.setdefault(event["job"]["name"].split(".")[-1], []).append(event)

    chunks = complete["purge_chunk"]
    assert len(chunks) == run["chunks_completed"]
    for event in chunks:
        (output,) = event["outputs"]
        assert (output["namespace"], output["name"]) == (namespace, name)
        sql = event["job"]["facets"]["sql"]["query"]
        assert sql.startswith('DELETE FROM "airflow_t"."audit"') and '"at" < %(cutoff)s' in sql, sql
        facet = event["run"]["facets"]["retention"]
        assert facet["policy"] == "t_audit_asset" and facet["cutoff"] == "2026-01-15T00:00:00Z"
        assert facet["runKey"] == "t_audit_asset@2026-01-15T00:00:00Z" and facet["chunkLabel"].startswith("blocks [")
    assert sum(e["run"]["facets"]["retention"]["rowsDeleted"] for e in chunks) == run["rows_deleted"]

    (plan,) = complete["plan"]
    assert [(i["namespace"], i["name"]) for i in plan["inputs"]] == [(namespace, name)]
    planned = plan["run"]["facets"]["retention"]
    assert planned["chunks"] == run["chunks_completed"] and planned["rowsPlanned"] == run["rows_planned"]

    # The verify task's asset outlet, named by the Postgres provider's own converter, is the same dataset.
    (verify,) = complete["verify"]
    assert [(o["namespace"], o["name"]) for o in verify["outputs"]] == [(namespace, name)]


PARTS = RetentionPolicy(
    name="t_parts_lineage",
    conn_id="retention_target",
    table="airflow_t.parts",
    timestamp_column="created_at",
    retention="10 days",
    expired_partitions="drop",
    archive_table=None,
)


def test_a_partition_drop_is_a_lifecycle_change() -> None:
    """The facets of a partition chunk that dropped its partition, from the chunk's own result (no database:
    a partition chunk's SQL is known without the catalog)."""
    pytest.importorskip("airflow.providers.openlineage")
    from airflow.sdk import Connection

    from airflow_retention.core.running.engine import ChunkResult
    from airflow_retention.operators.retention import RetentionChunkOperator

    op = RetentionChunkOperator(
        task_id="c", policy=PARTS, from_plan=True, partition="airflow_t.m01", partition_oid=1, action="drop"
    )
    policy, chunk = op._chunk_and_policy()
    result = ChunkResult("t_parts_lineage@2026-04-05T00:00:00Z", chunk.key, rows_deleted=2976, outcome="dropped")
    op.lineage_state = {"policy": policy, "chunk": chunk, "cutoff": "2026-04-05T00:00:00Z", "summary": result.summary()}
    lineage = op.get_openlineage_facets_on_complete(None)
    conn = Connection.get("retention_target")
    table, leaf = lineage.outputs
    assert (table.namespace, table.name) == (f"postgres://{conn.host}:{conn.port}", f"{E2E_DB}.airflow_t.parts")
    assert leaf.name == f"{E2E_DB}.airflow_t.m01"
    assert leaf.facets["lifecycleStateChange"].lifecycleStateChange.value == "DROP"
    assert lineage.job_facets["sql"].query == (
        'ALTER TABLE "airflow_t"."parts" DETACH PARTITION "airflow_t"."m01" CONCURRENTLY;\nDROP TABLE "airflow_t"."m01"'
    )
    facet = lineage.run_facets["retention"]
    assert (facet.rowsDeleted, facet.outcome, facet.action, facet.partition) == (
        2976,
        "dropped",
        "drop",
        "airflow_t.m01",
    )


def test_without_the_provider_nothing_is_reported_and_nothing_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider's import made to fail, as when it is not installed: the DAG builds, and the methods the
    provider would call answer None."""
    from airflow_retention.dag_factory import build_dag

    for module in ("airflow.providers.openlineage", "airflow.providers.openlineage.extractors"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    dag = build_dag(PARTS)
    plan, chunks = (
        dag.task_dict["retention_t_parts_lineage.plan"],
        dag.task_dict["retention_t_parts_lineage.purge_chunk"],
    )
    assert plan.get_openlineage_facets_on_start() is None
    plan.lineage_state = {"run_key": "k", "cutoff": "2026-04-05T00:00:00Z", "chunks": 0, "rows_planned": 0}
    assert plan.get_openlineage_facets_on_complete(None) is None
    assert chunks.operator_class.get_openlineage_facets_on_start is not None  # the mapped task's class has them
