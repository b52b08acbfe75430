"""``airflow-retention init DAGS_FOLDER``: the DAG file and the example policies in a dags folder, never
overwritten without ``--force``, the next steps printed; then the printed steps, run with the real ``airflow``
on a fresh install, list the DAGs and unpause one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from airflow_retention.scaffold import DAG_FILE, FILES, POLICIES_FILE, source
from tests.airflow_cli import airflow, airflow_json, newcomer_env
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
    from airflow_retention.core.policy.loading import load_policies
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


def printed_commands(out: str, step: int) -> list[str]:
    """The commands of next step ``step`` of init's output: its indented lines."""
    text = out.split(f"  {step}. ", 1)[1].split(f"  {step + 1}. ", 1)[0]
    return [line.strip() for line in text.splitlines()[1:] if line.strip()]


def test_the_last_step_makes_airflow_parse_the_folder_before_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `airflow dags list` alone prints nothing until the dag-processor has parsed the new file.
    result = run_cli(capsys, "init", str(tmp_path))
    first = example_policy_names()[0]
    assert printed_commands(result.out, 5) == [
        "airflow dags reserialize",
        "airflow dags list | grep retention_",
        f"airflow dags unpause retention_{first}",
    ]


@pytest.mark.airflow
def test_after_init_and_a_connection_airflow_lists_the_policies_dags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dags = tmp_path / "dags"
    result = run_cli(capsys, "init", str(dags))
    assert result.code == 0
    env = newcomer_env(tmp_path / "airflow-home", dags, SERVER_DSN)
    bin_dir = Path(sys.executable).parent
    names = sorted(f"retention_{name}" for name in example_policy_names())
    airflow(bin_dir, env, "db", "migrate")
    # The printed last step as written, on a fresh install with no dag-processor running.
    shell = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    for command in printed_commands(result.out, 5):
        done = subprocess.run(["bash", "-c", command], env=shell, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
        if "dags list" in command:
            assert sorted(line.split()[0] for line in done.stdout.splitlines()) == names
    listed = airflow_json(bin_dir, env, "dags", "list")
    assert sorted(d["dag_id"] for d in listed) == names
    paused = {d["dag_id"]: str(d["is_paused"]) for d in listed}
    assert paused == {name: str(name != f"retention_{example_policy_names()[0]}") for name in names}  # one unpaused
    assert airflow_json(bin_dir, env, "dags", "list-import-errors") == []
