"""A sample of generated cases run the way a deployment runs them: the policy's DAG built by the DAG
factory from YAML and run by Airflow's ``dag.test()`` (plan task, mapped chunk tasks, verify sensor),
then checked by the same oracle. This is where the run's date travels from the DAG run to every cutoff."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from hypothesis import example, given

from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import DAGS_FOLDER, E2E_DSN

from .cases import Case, cases
from .harness import CaseRun, expected_refusal, q, run_case
from .settings import fuzz_settings

pytestmark = pytest.mark.airflow

POLICIES = DAGS_FOLDER.parent / "differential_policies.yaml"
DAG_FILE = """
# The differential suite's DAGs: one per policy of the file it writes (tests/differential/test_dag_runs.py).
from pathlib import Path

from airflow_retention.dag_factory import build_dags_from_yaml

_path = Path({path!r})
if _path.exists():
    globals().update(build_dags_from_yaml(_path))
"""


@pytest.fixture(scope="module", autouse=True)
def airflow_home() -> Iterator[None]:
    """The throwaway AIRFLOW_HOME's metadata database, and a DAG file that reads the suite's policies."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, stdout=subprocess.DEVNULL, env=os.environ.copy())
    dag_file = DAGS_FOLDER / "differential_dags.py"
    dag_file.write_text(DAG_FILE.format(path=str(POLICIES)))
    yield
    POLICIES.unlink(missing_ok=True)
    dag_file.unlink(missing_ok=True)


def dag_test(run: CaseRun, policy_dict: dict[str, Any]) -> Any:
    """Write the case's policy as YAML, load its DAG and run it with ``dag.test()`` for the run date."""
    from airflow_retention.compat import dagbag

    name = f"diff_{run.schema[2:]}"
    data = {**policy_dict, "name": name}
    POLICIES.write_text(yaml.safe_dump({"policies": [data]}, sort_keys=False))
    bag = dagbag(str(DAGS_FOLDER))
    dag = bag.dags[f"retention_{name}"]
    # @daily in Airflow 3: the run of logical date D is the day ending at D, the case's run date.
    dag_run = dag.test(logical_date=run.case.anchor)
    if dag_run.data_interval_end != run.case.anchor:
        run.problems.append(f"the DAG run's data interval ends {dag_run.data_interval_end}, not {run.case.anchor}")
    if str(dag_run.state) not in ("success", "DagRunState.SUCCESS"):
        run.problems.append(f"the DAG run ended {dag_run.state}")
    policy = RetentionPolicy.from_dict(data)
    key = run_key(policy, freeze_cutoff(policy, run.case.anchor))
    ls = f'"{run.schema}_ledger"'
    chunks = [
        ChunkSpec(key=r[0], lo=r[1], hi=r[2])
        for r in q(run.admin, f"SELECT chunk_key, lo, hi FROM {ls}.chunks WHERE run_key = %(k)s", {"k": key})
    ]
    return SimpleNamespace(run_key=key, chunks=chunks)


def _midnight(case: Case) -> bool:
    """Run dates the DAG's @daily schedule can have (refused cases are the core tests' to check)."""
    return case.anchor.hour == 0 and case.anchor.minute == 0 and case.anchor.microsecond == 0


def month_end_tenant_case() -> Case:
    """A run dated 2024-03-31 keeping 1 month (cutoff 02-29), tenant acme 7 days (cutoff 03-24): acme's
    rows of 03-22 and 03-23 are eligible. A tenant cutoff rebuilt as cutoff + retention (03-29) - 7 days
    = 03-22 would leave them (issue 21, defect 11); the oracle computes 03-24 from the run's own date."""
    stamps = ["2024-03-22T12:00:00+00:00", "2024-03-23T23:59:59+00:00", "2024-03-24T00:00:01+00:00",
              "2024-02-28T00:00:00+00:00", "2024-03-01T00:00:00+00:00"]  # fmt: skip
    rows = [[i + 1, 1000 + i, ts, tenant, "closed", 1] for i, (ts, tenant) in
            enumerate([(t, "acme") for t in stamps] + [(t, "globex") for t in stamps])]  # fmt: skip
    return Case(
        table={
            "names": {"table": "events", "ts": "created_at", "tenant": "tenant_id", "key": "id", "status": "status"},
            "ts_type": "timestamptz",
            "tenant_type": "text",
            "key_kind": "bigint",
            "partition": None,
            "default": False,
            "ts_index": True,
        },
        rows=rows,
        refs=[],
        tenant_table=None,
        policy={
            "name": "diff",
            "conn_id": "retention_target",
            "timestamp_column": "created_at",
            "retention": "1 month",
            "chunk_by": "block",
            "batch_size": 3,
            "target_batch_time": 0,
            "chunk_rows": 6,
            "tenant_column": "tenant_id",
            "tenant_retention": {"acme": "7 days"},
        },
        condition=None,
        run_date="2024-03-31T00:00:00+00:00",
    )


@fuzz_settings("dag")
@example(month_end_tenant_case())
@given(cases(faults=False).filter(lambda c: expected_refusal(c) is None and _midnight(c)))
def test_dag_runs(case: Case) -> None:
    run_case(
        case,
        dsn=E2E_DSN,
        executor=dag_test,
        policy_extra={"schedule": "@daily", "start_date": "2023-01-01", "retries": 0},
    )
