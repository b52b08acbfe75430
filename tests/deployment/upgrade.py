"""The upgrade drill's pieces (``test_upgrade_drill.py``): the previous release's wheel, built from its commit;
the working tree's wheel; a virtual environment of their own holding this suite's Airflow; and a Deployment
whose components run from that environment and can be stopped, all at once, and started again around a
wheel swap.

The environment is not the suite's ``.venv``: the drill swaps the package in it, and ``.venv`` holds the
working tree as an editable install. Airflow goes in at the versions ``.venv`` holds (every distribution
pinned by a constraints file written from this interpreter's), so that pip resolves nothing and the drill
tests the Airflow the rest of the suite tests; ``--no-compile`` leaves the bytecode to the components'
first imports (measured: 25-30 s with pip's cache instead of 60 s, 105 s with a free resolution).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import distributions, version
from pathlib import Path
from typing import Any

from airflow_retention.demo.postgres import admin_execute
from tests.deployment.harness import REPO, Deployment, DeploymentTimeout, budget, session_pids

PACKAGE = "airflow-retention"
# The previous release: git tag v0.1.0 (CHANGELOG.md). A clone may come without tags, never without the
# commit, so the drill builds from the commit's hash.
PREVIOUS = "0.1.0"
PREVIOUS_COMMIT = "ed99183aef2e467fafe01a41b67a3b332c8c4d59"
PREVIOUS_LEDGER = 6  # its ledger schema version
# What a wheel of the working tree is not built from (as tests/wheel and ./dev oldest-install copy the tree).
NOT_BUILT = (
    ".git", ".venv*", "build", "dist", "site", "test-artifacts", "*.egg-info", "__pycache__", ".hypothesis",
    ".ruff_cache", ".pytest_cache",
)  # fmt: skip
STEP_TIMEOUT = 900  # one pip or git command


class PreviousReleaseMissing(RuntimeError):
    """The checkout lacks the previous release's commit (a shallow clone): the drill cannot build it."""


def run(*args: str | Path, timeout: float = STEP_TIMEOUT, **kwargs: Any) -> str:
    """Run a command; its stdout. A failure raises with the command and both streams."""
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    if done.returncode != 0:
        command = " ".join(map(str, args))
        raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def check_previous_release(repo: Path = REPO, commit: str = PREVIOUS_COMMIT) -> None:
    """Fail, saying what to do, unless ``repo`` is a git checkout that holds ``commit``."""
    what = f"the upgrade drill builds airflow-retention {PREVIOUS} from commit {commit} (tag v{PREVIOUS})"
    if shutil.which("git") is None:
        raise PreviousReleaseMissing(f"{what}, and needs git: install it")
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        raise PreviousReleaseMissing(f"{what}, but {repo} is not a git checkout: run it in a clone")
    found = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if found.returncode != 0:
        shallow = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
        ).stdout.strip()
        how = "a shallow clone: git fetch --unshallow" if shallow == "true" else f"git fetch origin {commit}"
        raise PreviousReleaseMissing(f"{what}, which the clone {repo} does not have ({how}, then run it again)")


def pip(venv: Path, *args: str | Path) -> str:
    """pip of this interpreter, working on ``venv`` (which has no pip of its own: ``--without-pip`` saves
    ensurepip's 15 s)."""
    return run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", *args)


def build_previous_wheel(root: Path) -> Path:
    """The previous release's wheel, built from its commit's files (``git archive``), into ``root/dist``."""
    check_previous_release()
    source = root / f"source-{PREVIOUS}"
    source.mkdir()
    run("bash", "-o", "pipefail", "-c", 'git -C "$0" archive "$1" | tar -x -C "$2"', REPO, PREVIOUS_COMMIT, source)
    return _wheel(source, root / f"dist-{PREVIOUS}")


def build_current_wheel(root: Path) -> Path:
    """The working tree's wheel, built from a copy of it: an editable install's build files stay as they are."""
    source = root / "source-current"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_BUILT))
    return _wheel(source, root / "dist-current")


def _wheel(source: Path, dist: Path) -> Path:
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, source)
    (wheel,) = dist.glob("airflow_retention-*.whl")
    shutil.rmtree(source)
    return wheel


def suite_constraints() -> str:
    """``name==version`` of every distribution this interpreter has, but this package: the versions the suite
    tests, as a constraints file."""
    pins: dict[str, str] = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        key = re.sub(r"[-_.]+", "-", name or "").lower()
        if key and key != PACKAGE and key not in pins:
            pins[key] = f"{name}=={dist.version}"
    return "\n".join(sorted(pins.values())) + "\n"


def make_venv(root: Path, wheel: Path) -> Path:
    """A virtual environment holding this suite's Airflow and providers-postgres, and ``wheel``."""
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    constraints = root / "constraints.txt"
    constraints.write_text(suite_constraints())
    pip(
        venv, "install", "--quiet", "--no-compile", "--constraint", constraints,
        f"apache-airflow=={version('apache-airflow')}",
        f"apache-airflow-providers-postgres=={version('apache-airflow-providers-postgres')}",
        wheel,
    )  # fmt: skip
    return venv


def prepare(root: Path) -> tuple[Path, Path, Path]:
    """``(venv with the previous release, previous wheel, current wheel)``: the current wheel builds while
    the previous one builds and installs."""
    check_previous_release()  # before anything is built
    with ThreadPoolExecutor(max_workers=1) as pool:
        current = pool.submit(build_current_wheel, root)
        previous = build_previous_wheel(root)
        venv = make_venv(root, previous)
        return venv, previous, current.result()


def installed_version(venv: Path) -> str:
    """The package's version in ``venv``, as its interpreter sees it (``-I``: no working directory)."""
    probe = f"from importlib.metadata import version; print(version({PACKAGE!r}))"
    return run(venv / "bin" / "python", "-I", "-c", probe).strip()


def upgrade_to(venv: Path, wheel: Path) -> None:
    """Install ``wheel`` over the package in ``venv`` as docs/deployment.md says (naming the Airflow there, so
    that pip keeps it); the environment must stay consistent."""
    pip(venv, "install", "--quiet", wheel, f"apache-airflow=={version('apache-airflow')}")
    pip(venv, "check")


# What the previous release says of a ledger: its code imported from its wheel (a zip Python imports from),
# the check its chunk and plan tasks make before anything else (``Ledger.ensure``).
_LEDGER_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import psycopg2
import airflow_retention
from airflow_retention.core.ledger import Ledger
conn = psycopg2.connect(sys.argv[2])
try:
    Ledger(sys.argv[3]).ensure(conn)
    print(airflow_retention.__version__, "accepted")
except Exception as exc:
    print(airflow_retention.__version__, type(exc).__name__, exc)
"""


def previous_release_on_ledger(venv: Path, wheel: Path, dsn: str, schema: str) -> str:
    """``<version> accepted`` or ``<version> <error> <message>``: the previous release's ledger check on the
    ledger ``schema`` of ``dsn``."""
    return run(venv / "bin" / "python", "-I", "-c", _LEDGER_CHECK, wheel, dsn, schema).strip()


def one(conn: Any, sql: str, params: Any = None) -> Any:
    """The one row of a query on an autocommit connection."""
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchone()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class UpgradeDeployment(Deployment):
    """A :class:`Deployment` (LocalExecutor) whose components run from the virtual environment ``venv``, in
    the deployment's home as working directory (never the checkout: its package must not shadow the wheel),
    and can be killed all at once (:meth:`kill_all`) and started again (:meth:`start_components`) over the
    same metadata database."""

    def __init__(self, *, venv: Path, **kwargs: Any) -> None:
        self.venv = venv
        self.bin = venv / "bin"
        super().__init__(**kwargs)

    def _environment(self) -> dict[str, str]:
        env = super()._environment()
        for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):
            env.pop(name, None)
        suite_bin = str(Path(sys.executable).parent)
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != suite_bin]
        env.update({"VIRTUAL_ENV": str(self.venv), "PATH": os.pathsep.join([str(self.bin), *path])})
        return env

    def airflow(self, *args: str, check: bool = True, timeout: float = budget(75)) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [str(self.bin / "airflow"), *args],
                env=self.env,
                cwd=self.home,
                check=check,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            self.failed = True
            raise DeploymentTimeout(f"airflow {' '.join(args)} ran over {timeout:.0f}s\n{self.diagnostics()}") from None

    def start(self, health_timeout: float = budget(45)) -> UpgradeDeployment:
        if self.celery:
            raise NotImplementedError("the upgrade drill's deployment runs the LocalExecutor")
        admin_execute(self.server_dsn, f'CREATE DATABASE "{self.metadata_db}"')
        self.airflow("db", "migrate")
        self.start_components(health_timeout)
        return self

    def start_components(self, health_timeout: float = budget(45), *, api_server_first: bool = False) -> None:
        """Start every component (again) and wait until Airflow reports them healthy. Each log file is
        appended to: a restarted component's log follows the previous one's. ``api_server_first``: the others
        only once the api-server answers, as docs/deployment.md says to restart (a task queued before it
        listens fails)."""
        rest = list(self.components)
        if api_server_first and "api-server" in rest:
            rest.remove("api-server")
            self._start("api-server")
            self.wait_until(self._api_server_answers, health_timeout, "the api-server to answer")
        for component in rest:
            self._start(component)
        self._token = None
        self.wait_healthy(health_timeout)

    def _start(self, component: str) -> None:
        log = (self.home / f"{component}.log").open("ab")
        args = [str(self.bin / "airflow"), component]
        if component == "api-server":
            args += ["--port", str(self.port)]
        self.processes[component] = subprocess.Popen(
            args, env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _api_server_answers(self) -> bool:
        import requests

        try:
            requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=10).json()
        except ValueError:  # not JSON yet: still starting
            return False
        return True

    def kill_all(self, timeout: float = budget(10)) -> list[int]:
        """SIGKILL every process of this deployment at once: the components, the executor's workers, the task
        supervisors and the task processes, as a machine or container stop does. None of them gets to report
        anything: a running task instance stays ``running`` in the metadata database. Returns the pids.

        Found by session (each component starts one; the task processes keep it, in process groups of their
        own) and, for any process that left it, by ``AIRFLOW_HOME`` (a process that sets its title may have
        overwritten the environment /proc shows, so that alone would miss some)."""
        pids = {pid for proc in self.processes.values() for pid in session_pids(proc.pid)}
        marker = f"AIRFLOW_HOME={self.home}".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                if marker in (pid_dir / "environ").read_bytes().split(b"\0"):
                    pids.add(int(pid_dir.name))
            except OSError:
                continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stopped, self.processes = self.processes, {}
        for proc in stopped.values():
            proc.wait(timeout=timeout)
        self.wait_until(lambda: not any(map(process_alive, pids)), timeout, "every process to die", interval=0.1)
        return sorted(pids)
