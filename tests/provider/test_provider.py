"""The package is an Airflow provider and its example DAG file parses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.airflow


def test_provider_info_names_every_module() -> None:
    import importlib

    from airflow_retention.get_provider_info import get_provider_info

    info = get_provider_info()
    assert info["package-name"] == "airflow-retention"
    for kind in ("operators", "sensors", "hooks", "triggers"):
        for module in info[kind][0]["python-modules"]:
            importlib.import_module(module)


def test_airflow_providers_list_shows_the_package() -> None:
    airflow = Path(sys.executable).with_name("airflow")
    out = subprocess.run(
        [str(airflow), "providers", "list", "--output", "plain"], check=True, capture_output=True, text=True
    ).stdout
    assert "airflow-retention" in out


def test_example_dags_parse_without_import_errors() -> None:
    from airflow_retention.compat import dagbag

    bag = dagbag(str(REPO / "dags"))
    assert bag.import_errors == {}
    assert {"retention_webhook_deliveries", "retention_tenant_events", "retention_audit_log"} <= set(bag.dags)


def bag_of(folder: Path, policies: Path) -> Any:
    """The DagBag of the shipped DAG file copied into ``folder``, reading ``policies``."""
    from airflow_retention.compat import dagbag

    shutil.copy(REPO / "dags" / "retention_dags.py", folder / "retention_dags.py")
    old = os.environ.get("AIRFLOW_RETENTION_POLICIES")
    os.environ["AIRFLOW_RETENTION_POLICIES"] = str(policies)
    try:
        return dagbag(str(folder))
    finally:
        if old is None:
            del os.environ["AIRFLOW_RETENTION_POLICIES"]
        else:
            os.environ["AIRFLOW_RETENTION_POLICIES"] = old


def test_a_bad_policy_is_a_failing_dag_of_its_own_and_never_an_import_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An import error would make Airflow 3's dag-processor drop every DAG of the file: each bad policy
    becomes a DAG under its own id that names the policy and the field, and the good ones load as usual."""
    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    broken = text.replace("retention: 90 days", "retention: 0 days").replace(
        "key_column: id\n    timestamp_column: logged_at", "key_column: id\n    timestamp_column: '\"logged\".at'"
    )
    assert broken != text
    (tmp_path / "policies.yaml").write_text(broken)
    with caplog.at_level("WARNING", logger="airflow_retention.dag_factory"):
        bag = bag_of(tmp_path, tmp_path / "policies.yaml")
    assert bag.import_errors == {}
    good = bag.dags["retention_webhook_deliveries"]
    assert "invalid" not in good.tags and "retention_webhook_deliveries.plan" in good.task_ids
    for dag_id, where in (
        ("retention_tenant_events", "policy 'tenant_events', field 'retention'"),
        ("retention_audit_log", "policy 'audit_log', field 'timestamp_column'"),
    ):
        bad = bag.dags[dag_id]
        assert set(bad.tags) == {"retention", "invalid"} and bad.schedule is None
        assert where in bad.description and where in bad.doc_md
        (task,) = bad.tasks
        assert task.retries == 0
        with pytest.raises(Exception, match=re.escape(where)) as raised:
            task.execute({})
        assert type(raised.value).__name__ == "AirflowFailException"  # failed at once, never retried
        assert any(where in r.getMessage() for r in caplog.records)  # the dag-processor's log says it too
    assert "retention_invalid_policies" not in bag.dags


def test_entries_without_a_usable_name_and_an_unreadable_file_share_one_dag(tmp_path: Path) -> None:
    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    unnamed = "  - just a string\n  - {name: Bad-Name, table: t, timestamp_column: at, retention: 1 day}\n"
    entries = text.replace("policies:\n", "policies:\n" + unnamed, 1)
    (tmp_path / "entries.yaml").write_text(entries)
    bag = bag_of(tmp_path, tmp_path / "entries.yaml")
    assert bag.import_errors == {}
    assert {"retention_webhook_deliveries", "retention_audit_log"} <= set(bag.dags)
    shared = bag.dags["retention_invalid_policies"]
    assert "policy '#1': each policy must be a mapping" in shared.description
    assert "policy 'Bad-Name', field 'name'" in shared.description

    (tmp_path / "broken.yaml").write_text("policies:\n  - name: [unclosed\n")
    bag = bag_of(tmp_path, tmp_path / "broken.yaml")
    assert bag.import_errors == {}
    assert list(bag.dags) == ["retention_invalid_policies"]
    assert "cannot read policies file" in bag.dags["retention_invalid_policies"].description


def test_a_duplicate_name_keeps_the_first_policy_and_reports_the_second_apart() -> None:
    from airflow_retention.core.errors import PolicyError
    from airflow_retention.dag_factory import build_dags
    from tests.provider.test_dag_factory import POLICY

    dags = build_dags([POLICY], [PolicyError(POLICY.name, "name", "is used by more than one policy")])
    assert "invalid" not in dags[f"retention_{POLICY.name}"].tags
    assert "is used by more than one policy" in dags["retention_invalid_policies"].description


def test_an_invalid_schedule_is_reported_with_its_policy(tmp_path: Path) -> None:
    from airflow_retention.core.policy.loading import load_policies_lenient
    from airflow_retention.dag_factory import build_dags

    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    (tmp_path / "p.yaml").write_text(
        text.replace("tags: [audit]", "tags: [audit]\n    schedule: '61 * * * *'"),
    )
    policies, errors = load_policies_lenient(tmp_path / "p.yaml")
    dags = build_dags(policies, errors)
    assert "retention_webhook_deliveries" in dags and "invalid" not in dags["retention_webhook_deliveries"].tags
    assert "policy 'audit_log': cannot build its DAG" in dags["retention_audit_log"].description
    assert set(dags["retention_audit_log"].tags) == {"retention", "invalid"}


def test_a_run_of_a_bad_policys_dag_fails_at_once_with_the_error(tmp_path: Path) -> None:
    """What a trigger of the bad policy's DAG does under a real Airflow task runner (``dag.test()``)."""
    from airflow_retention.dag_factory import build_dags_from_yaml
    from tests.provider.conftest import task_instances, utc

    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace("retention: 90 days", "retention: 0 days"))
    dag = build_dags_from_yaml(tmp_path / "p.yaml")["retention_tenant_events"]
    dag_run = dag.test(logical_date=utc("2026-01-01"))
    assert dag_run.state == "failed"
    (ti,) = task_instances(dag_run)
    assert (ti.task_id, ti.state, ti.try_number) == ("policy_error", "failed", 1)
