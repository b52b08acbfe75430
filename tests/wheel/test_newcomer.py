"""A new user's first steps, from the built wheel: a fresh virtual environment with Airflow and the wheel
(as README's "Install into an existing Airflow" says), ``airflow-retention init`` into a dags folder, a
connection; then Airflow's own commands show the provider, the plugin and the policies' DAGs.

Built from a copy of the checkout, so that the build leaves nothing in it. pip's cache makes the install
take about a minute; the first run on a machine downloads Airflow.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.airflow_cli import airflow, airflow_json, listed_dag_ids, newcomer_env
from tests.conftest import REPO, SERVER_DSN

pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]

# The Airflow the main suite tests (3.3.2 in CI): the wheel must install next to it and leave it in place.
AIRFLOW_VERSION = version("apache-airflow")
PLUGIN = "retention"  # [project.entry-points."airflow.plugins"] in pyproject.toml
NOT_BUILT = (".git", ".venv", ".venv-oldest", "build", "dist", "site", "test-artifacts", "*.egg-info", "__pycache__")


def run(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="module")
def newcomer_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` of a fresh virtual environment holding Airflow and the wheel, nothing else of ours."""
    root = tmp_path_factory.mktemp("newcomer")
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_BUILT))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", root / "dist", source)
    (wheel,) = (root / "dist").glob("airflow_retention-*.whl")
    venv = root / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, f"apache-airflow=={AIRFLOW_VERSION}")
    return venv / "bin"


def test_the_wheel_holds_no_test_harness_and_installs_next_to_airflow(newcomer_bin: Path) -> None:
    py = newcomer_bin / "python"
    # -I: the installed wheel's metadata, not a checkout's egg-info found through the working directory.
    assert run(py, "-I", "-c", "import airflow; print(airflow.__version__)").strip() == AIRFLOW_VERSION
    listing = "import importlib.metadata as m; print('\\n'.join(map(str, m.files('airflow-retention'))))"
    files = run(py, "-I", "-c", listing)
    assert "airflow_retention/scaffold/retention_policies.yaml" in files
    assert "airflow_retention/scaffold/retention_dags.py" in files
    assert "deployment.py" not in files and "tests/" not in files


def test_after_init_airflow_shows_the_provider_the_plugin_and_the_dags(newcomer_bin: Path, tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    out = run(newcomer_bin / "airflow-retention", "init", dags)
    assert "airflow connections add retention_target" in out
    env = newcomer_env(tmp_path / "airflow-home", dags, SERVER_DSN)

    providers = airflow_json(newcomer_bin, env, "providers", "list")
    assert "airflow-retention" in [p["package_name"] for p in providers]

    plugins = airflow_json(newcomer_bin, env, "plugins")
    assert PLUGIN in [p["name"] for p in plugins], airflow(newcomer_bin, env, "plugins")

    policies = yaml.safe_load((dags / "retention_policies.yaml").read_text())["policies"]
    assert listed_dag_ids(newcomer_bin, env) == sorted(f"retention_{p['name']}" for p in policies)
    assert airflow_json(newcomer_bin, env, "dags", "list-import-errors") == []
