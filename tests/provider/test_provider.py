"""The package is an Airflow provider and its example DAG file parses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_a_bad_policy_is_an_import_error_naming_it_while_the_others_load(tmp_path: Path) -> None:
    from airflow_retention.compat import dagbag

    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    broken = text.replace("retention: 90 days", "retention: 0 days").replace(
        "key_column: id\n    timestamp_column: logged_at", "key_column: id\n    timestamp_column: '\"logged\".at'"
    )
    assert broken != text
    (tmp_path / "policies.yaml").write_text(broken)
    shutil.copy(REPO / "dags" / "retention_dags.py", tmp_path / "retention_dags.py")
    old = os.environ.get("AIRFLOW_RETENTION_POLICIES")
    os.environ["AIRFLOW_RETENTION_POLICIES"] = str(tmp_path / "policies.yaml")
    try:
        bag = dagbag(str(tmp_path))
    finally:
        if old is not None:
            os.environ["AIRFLOW_RETENTION_POLICIES"] = old
    assert "retention_webhook_deliveries" in bag.dags
    assert "retention_tenant_events" not in bag.dags
    assert "retention_audit_log" not in bag.dags
    (message,) = bag.import_errors.values()
    assert "policy 'tenant_events', field 'retention'" in message
    assert "policy 'audit_log', field 'timestamp_column'" in message


def test_an_invalid_schedule_is_reported_with_its_policy(tmp_path: Path) -> None:
    from airflow_retention.core.policy import load_policies_lenient
    from airflow_retention.dag_factory import build_dags

    text = (REPO / "dags" / "retention_policies.yaml").read_text()
    (tmp_path / "p.yaml").write_text(
        text.replace("tags: [audit]", "tags: [audit]\n    schedule: '61 * * * *'"),
    )
    policies, errors = load_policies_lenient(tmp_path / "p.yaml")
    dags = build_dags(policies, errors)
    assert "retention_audit_log" not in dags and "retention_webhook_deliveries" in dags
    with pytest.raises(Exception, match="policy 'audit_log': cannot build its DAG"):
        dags["retention_invalid_policies"].validate()
