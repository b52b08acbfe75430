"""The Retention view and the command show the metadata database's policies like any other, under the DAG
that runs them (``retention_airflow_metadata``): found from the settings file the DAG file reads, their
runs from the ledger in the metadata database, the backfill hints naming that DAG."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_retention.cli.report import backfill_command
from airflow_retention.demo import airflow_metadata as am
from airflow_retention.metadata import METADATA_DAG_ID
from airflow_retention.plugins.data import PolicySet, dag_id, load_panels, read_policies
from airflow_retention.plugins.render import overview_page
from airflow_retention.scaffold import METADATA_SETTINGS_FILE, source

from .test_side_by_side import ANCHOR, RUN_DATE

pytestmark = pytest.mark.airflow


def test_the_view_shows_each_tables_policy_under_the_metadata_dag(
    tmp_path: Path, metadata_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = tmp_path / METADATA_SETTINGS_FILE
    settings.write_text(source(METADATA_SETTINGS_FILE).replace("retention: 90 days", "retention: 30 days"))
    monkeypatch.setenv("AIRFLOW_RETENTION_METADATA", str(settings))
    shown = read_policies()
    metadata = [p for p in shown.policies if p.dag_id == METADATA_DAG_ID]
    assert len(metadata) >= 15 and {dag_id(p) for p in metadata} == {METADATA_DAG_ID}
    by_name = {p.name: p for p in metadata}
    am.seed_metadata(metadata_db, ANCHOR, am.MetadataShape(dags=3, days=60, log_rows=500, job_rows=10))
    am.run_policies(metadata_db, [by_name["airflow_dag_run"], by_name["airflow_log"]], RUN_DATE)

    panels = load_panels([by_name["airflow_dag_run"], by_name["airflow_log"]], dsn=metadata_db, as_of=ANCHOR)
    assert all(p.error is None and p.status is not None and p.status.runs for p in panels), panels
    html = overview_page(PolicySet(shown.source, [p.policy for p in panels]), panels, ANCHOR)
    assert "airflow_dag_run" in html and f"DAG <code>{METADATA_DAG_ID}</code>" in html
    missed = panels[0].status.missed if panels[0].status else []
    if missed:
        assert f"--dag-id {METADATA_DAG_ID} " in backfill_command(panels[0].policy, missed)

    # A wrong settings file: a problem under the metadata DAG, the other policies still shown.
    settings.write_text("airflow_metadata:\n  retention: 30 days\n")
    broken = read_policies()
    assert [p.dag_id for p in broken.problems if "conn_id" in p.message] == [METADATA_DAG_ID]
    assert not [p for p in broken.policies if p.dag_id == METADATA_DAG_ID]
