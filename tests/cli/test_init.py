"""``airflow-retention init DAGS_FOLDER``: the DAG file and the example policies in a dags folder, never
overwritten without ``--force``, the next steps printed; then the real ``airflow dags list`` shows the DAGs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from airflow_retention.scaffold import DAG_FILE, FILES, POLICIES_FILE, source
from tests.airflow_cli import airflow_json, listed_dag_ids, newcomer_env
from tests.conftest import REPO, SERVER_DSN

from .helpers import run_cli


def example_policy_names() -> list[str]:
    return [p["name"] for p in yaml.safe_load(source(POLICIES_FILE))["policies"]]


def test_the_repository_dags_are_the_shipped_scaffold() -> None:
    # One source: dags/ links to the files the package ships (and the demo runs), so they cannot drift.
    for name in FILES:
        assert (REPO / "dags" / name).read_text() == source(name)
        assert (REPO / "dags" / name).resolve() == (REPO / "airflow_retention" / "scaffold" / name).resolve()


def test_init_writes_both_files_and_prints_the_next_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dags = tmp_path / "new" / "dags"
    result = run_cli(capsys, "init", str(dags))
    assert result.code == 0, result.err
    assert sorted(p.name for p in dags.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (dags / name).read_text() == source(name)
    out = result.out
    assert f"wrote {dags / DAG_FILE}" in out and f"wrote {dags / POLICIES_FILE}" in out
    assert "airflow connections add retention_target --conn-uri 'postgresql://" in out
    assert 'airflow pools set NAME 4 "retention"' in out  # the examples use no pool: how to add one
    first = example_policy_names()[0]
    assert f"airflow-retention --policies {dags / POLICIES_FILE} plan {first} --date " in out


def test_init_names_the_pools_the_policies_use(tmp_path: Path) -> None:
    from airflow_retention.core.policy import load_policies
    from airflow_retention.scaffold import next_steps

    path = tmp_path / POLICIES_FILE
    doc = yaml.safe_load(source(POLICIES_FILE))
    doc["defaults"]["pool"] = "retention_db"
    path.write_text(yaml.safe_dump(doc))
    steps = "\n".join(next_steps(tmp_path, load_policies(path), "2026-06-01"))
    assert 'airflow pools set retention_db 4 "retention"' in steps
    assert "pool: NAME" not in steps


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / POLICIES_FILE).write_text("# my own policies\n")
    result = run_cli(capsys, "init", str(tmp_path))
    assert result.code == 2
    assert f"{tmp_path / POLICIES_FILE} already exists" in result.err and "--force" in result.err
    # Nothing written: not even the DAG file, which did not exist.
    assert (tmp_path / POLICIES_FILE).read_text() == "# my own policies\n"
    assert not (tmp_path / DAG_FILE).exists()

    result = run_cli(capsys, "init", str(tmp_path), "--force")
    assert result.code == 0, result.err
    assert (tmp_path / POLICIES_FILE).read_text() == source(POLICIES_FILE)


def test_init_into_a_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "dags").write_text("")
    result = run_cli(capsys, "init", str(tmp_path / "dags"))
    assert result.code == 2 and "is not a directory" in result.err


@pytest.mark.airflow
def test_after_init_and_a_connection_airflow_lists_the_policies_dags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dags = tmp_path / "dags"
    assert run_cli(capsys, "init", str(dags)).code == 0
    env = newcomer_env(tmp_path / "airflow-home", dags, SERVER_DSN)
    bin_dir = Path(sys.executable).parent
    assert listed_dag_ids(bin_dir, env) == sorted(f"retention_{name}" for name in example_policy_names())
    assert airflow_json(bin_dir, env, "dags", "list-import-errors") == []
