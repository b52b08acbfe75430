"""A real Airflow 3 deployment on this machine, for the scheduler tests, the drills and the benchmarks.

Metadata in a PostgreSQL database of its own, LocalExecutor (or CeleryExecutor), the project's ``dags/``
as the dags folder, and the real components as separate processes: api-server (on a free port),
scheduler, dag-processor, triggerer. ``with Deployment(...) as d:`` starts them, waits for health and
always stops them; a failed run's component logs are kept and their paths printed.

With ``executor="CeleryExecutor"`` it also starts ``celery_workers`` Celery workers (``airflow celery
worker``), each in a session of its own, with Redis as the broker (a database of its own on the Redis
server, flushed at start and at stop) and the metadata database as the result backend. Each worker gets
a hostname of its own (the TI's ``hostname``), as workers on separate machines would have, and
:meth:`Deployment.kill_worker` SIGKILLs one worker with every process it started, as a machine crash would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from airflow_retention.demo.airflow_home import airflow_environment
from airflow_retention.demo.postgres import admin_execute, sqlalchemy_url

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
REDIS_URL = os.environ.get("RETENTION_TEST_REDIS_URL", "redis://127.0.0.1:6379")
# The Redis key that marks a Redis database as taken by a running Deployment (it expires if never released).
REDIS_CLAIM = "airflow-retention:deployment"
WORKER_NAME_ENV = "RETENTION_WORKER_HOSTNAME"
# The repository root: a Celery worker imports this module (its hostname callable) as ``tests.deployment.harness``,
# and the ``airflow`` script does not put the working directory on sys.path.
REPO = Path(__file__).resolve().parents[2]

# How long the deployment tests wait. Each wait polls and returns as soon as its condition holds, so on an idle
# machine a budget costs nothing; its size comes from a measured run: ``budget(s)`` for a step measured at ``s``
# seconds on this 2-core machine with both cores busy (a CPU hog on each; docs/deployment.md, "Tests on a loaded
# machine") is MARGIN times that, times ``$RETENTION_TEST_PATIENCE`` (default 1: raise it on a slower runner).
# A budget that runs out raises DeploymentTimeout with what the deployment was doing.
MARGIN = 4.0
PATIENCE = float(os.environ.get("RETENTION_TEST_PATIENCE", "1"))
# pytest-timeout for a deployment test: above the sum of any one test's budgets, so that a stuck step fails with
# DeploymentTimeout and its diagnostics, never with pytest-timeout's bare stack dump.
TEST_TIMEOUT = 3600 * PATIENCE
# If set, every wait appends ``{"what", "seconds", "budget", "ok"}`` as a JSON line here: the measured runs.
WAIT_LOG = os.environ.get("RETENTION_TEST_WAIT_LOG")
LOG_TAIL = 25  # lines of each component's log in the diagnostics


def budget(loaded_s: float) -> float:
    """Seconds to wait for a step measured at ``loaded_s`` seconds on the loaded 2-core machine."""
    return MARGIN * loaded_s * PATIENCE


class DeploymentTimeout(TimeoutError):
    """A wait ran out of its budget; the message holds the deployment's diagnostics."""


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors a poll may meet on a busy machine (a request or a connection that timed out): poll again."""
    import psycopg2
    import requests

    return (requests.ConnectionError, requests.Timeout, psycopg2.OperationalError)


def worker_hostname() -> str:
    """``[core] hostname_callable`` of the harness's Celery workers: the worker's own name, so that the
    task instances of two workers on this one machine record different hostnames."""
    return os.environ.get(WORKER_NAME_ENV) or socket.getfqdn()


def claim_redis_db(base_url: str = REDIS_URL, ttl: int = 3600) -> tuple[str, int]:
    """A Redis database no other Deployment uses (15 down to 1), flushed: ``(url, db number)``."""
    import redis

    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{base_url}/{db}")
        try:
            if client.set(REDIS_CLAIM, os.getpid(), nx=True, ex=ttl):
                client.flushdb()
                client.set(REDIS_CLAIM, os.getpid(), ex=ttl)
                return f"{base_url}/{db}", db
        finally:
            client.close()
    raise RuntimeError(f"no free Redis database on {base_url}: every one holds the key {REDIS_CLAIM}")


def release_redis_db(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def session_pids(sid: int) -> list[int]:
    """Every process of the session ``sid`` (a worker started with ``start_new_session``): the worker, its
    pool children, their task supervisors and the task processes (which have process groups of their own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after ")": state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def session_of(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def tcp_client_ports(pids: list[int]) -> set[int]:
    """The local ports of the established TCP connections of ``pids``: what ``pg_stat_activity.client_port``
    shows for their PostgreSQL sessions. Read them before killing the processes."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = list((Path("/proc") / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl, local_address, rem_address, st, queues, tr, retrnsmt, uid, timeout, inode
            if fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    """Airflow components as processes over a metadata database created on ``server_dsn``.

    :param server_dsn: a PostgreSQL server where the metadata database is created (and dropped).
    :param target_dsn: the database the retention DAGs purge (``retention_target`` connection).
    :param dags_folder: the dags folder, normally the project's ``dags/``.
    :param env: extra environment (``AIRFLOW_RETENTION_POLICIES``, executor settings, ...).
    :param executor: ``LocalExecutor`` or ``CeleryExecutor``.
    :param celery_workers: with ``CeleryExecutor``: how many Celery workers to start.
    :param celery_queues: the queues the workers consume (comma-separated), e.g. the policies' ``queue``.
    :param celery_concurrency: task slots of each worker (``--concurrency``).
    :param parse_interval: ``[dag_processor] min_file_process_interval``: how often the dag-processor parses a
        DAG file again when the file itself has not changed (a changed one is parsed at once). A test that edits
        the policies file, which the DAG file reads, waits for that; each parse of the project's DAG file costs
        about a CPU-second (0.16 of a core at 5 s, 0.04 at Airflow's default 30 s).
    """

    def __init__(
        self,
        *,
        server_dsn: str,
        target_dsn: str,
        dags_folder: Path,
        env: Mapping[str, str] | None = None,
        executor: str = "LocalExecutor",
        components: tuple[str, ...] = COMPONENTS,
        celery_workers: int = 2,
        celery_queues: str = "default",
        celery_concurrency: int = 2,
        parse_interval: int = 5,
    ) -> None:
        self.server_dsn = server_dsn
        self.target_dsn = target_dsn
        self.dags_folder = dags_folder
        self.extra_env = dict(env or {})
        self.executor = executor
        self.components = components
        self.home = Path(tempfile.mkdtemp(prefix="retention-deploy-"))
        self.metadata_db = f"retention_airflow_{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.failed = False
        self._token: str | None = None
        self.celery = executor == "CeleryExecutor"
        self.celery_workers = celery_workers if self.celery else 0
        self.celery_queues = celery_queues
        self.celery_concurrency = celery_concurrency
        self.parse_interval = parse_interval
        # Celery workers by name ("<prefix>-w1", ...): kept apart from ``processes`` since one may be killed.
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.killed_workers: set[str] = set()
        # The killed workers' TCP client ports (``pg_stat_activity.client_port``), read before the kill.
        self.killed_ports: dict[str, set[int]] = {}
        self.worker_prefix = f"retention-{uuid.uuid4().hex[:6]}"
        self.broker_url: str | None = None
        self.env = self._environment()
        self.waits: list[dict[str, Any]] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        """The components' environment: computed once, since they must share one JWT secret."""
        from psycopg2.extensions import make_dsn

        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update(airflow_environment(self.home, self.dags_folder, self.target_dsn))
        env.update(
            {
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(
                    make_dsn(self.server_dsn, dbname=self.metadata_db)
                ),
                "AIRFLOW__CORE__EXECUTOR": self.executor,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
                "AIRFLOW__API__BASE_URL": self.base_url,
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__API_AUTH__JWT_SECRET": uuid.uuid4().hex + uuid.uuid4().hex,
                "AIRFLOW__CORE__PARALLELISM": "8",
                # One api-server process. With the default four, uvicorn's supervisor pings each child and kills
                # one that does not answer within 5 s: on two loaded cores, children still importing Airflow
                # were killed and respawned for six minutes ("Child process [...] died") and the deployment
                # never became healthy. One process also leaves the cores to the tests.
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
                "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": str(self.parse_interval),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": str(self.parse_interval),
                # A DAG changed by an edit of the policies file gets its new serialized version (its doc, its
                # tasks) at the next parse rather than up to 30 s (the default) after the last write.
                "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "5",
                # Airflow 3.0, 3.1: the scheduler and the api-server re-read a changed serialized DAG at most this
                # often (default 10 s); in that window a trigger makes a run of the DAG's previous tasks.
                "AIRFLOW__CORE__MIN_SERIALIZED_DAG_FETCH_INTERVAL": "1",
                "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.celery:
            metadata = sqlalchemy_url(make_dsn(self.server_dsn, dbname=self.metadata_db))
            env.update(
                {
                    # The broker URL is set in start(), once a Redis database has been claimed.
                    "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{metadata}",
                    "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.celery_concurrency),
                    "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
                }
            )
        env.update(self.extra_env)
        return env

    def worker_env(self, name: str) -> dict[str, str]:
        """A worker's environment: its own hostname and its own log server port (one machine, many workers)."""
        return {
            **self.env,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{__name__}.worker_hostname",
            WORKER_NAME_ENV: name,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        }

    def airflow(self, *args: str, check: bool = True, timeout: float = budget(75)) -> subprocess.CompletedProcess[str]:
        """Run an ``airflow`` CLI command in this deployment's environment."""
        exe = str(Path(sys.executable).with_name("airflow"))
        try:
            return subprocess.run(
                [exe, *args], env=self.env, check=check, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            self.failed = True
            raise DeploymentTimeout(f"airflow {' '.join(args)} ran over {timeout:.0f}s\n{self.diagnostics()}") from None

    def start(self, health_timeout: float = budget(45)) -> Deployment:
        if self.celery and "AIRFLOW__CELERY__BROKER_URL" not in self.extra_env:
            self.broker_url, _ = claim_redis_db()
            self.env["AIRFLOW__CELERY__BROKER_URL"] = self.broker_url
        # Airflow's own bookkeeping commits without waiting for the disk: its scheduler, api-server and
        # tasks commit many times a second, and on a slow-syncing disk each flush cost 2-5 ms of the suite's
        # critical path. The server still writes and replays all of it; only a crash of PostgreSQL itself
        # (no test does that to a deployment) could lose the last few hundred milliseconds. Not the targets'.
        admin_execute(
            self.server_dsn,
            f'CREATE DATABASE "{self.metadata_db}"',
            f'ALTER DATABASE "{self.metadata_db}" SET synchronous_commit = off',
        )
        self.airflow("db", "migrate")
        exe = str(Path(sys.executable).with_name("airflow"))
        for component in self.components:
            log = (self.home / f"{component}.log").open("wb")
            args = [exe, component] + (["--port", str(self.port)] if component == "api-server" else [])
            self.processes[component] = subprocess.Popen(
                args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        for n in range(1, self.celery_workers + 1):
            self.start_worker(f"{self.worker_prefix}-w{n}")
        self.wait_healthy(health_timeout)
        for name in self.workers:
            self.wait_worker_ready(name, health_timeout)
        return self

    # -- Celery workers ------------------------------------------------------------------------------

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        """``airflow celery worker`` named ``name`` (Celery hostname ``celery@name``, TI hostname ``name``)
        on ``celery_queues``, in a session of its own."""
        exe = str(Path(sys.executable).with_name("airflow"))
        log = (self.home / f"{name}.log").open("wb")
        args = [
            exe, "celery", "worker",
            "--queues", self.celery_queues,
            "--concurrency", str(self.celery_concurrency),
            "--celery-hostname", name,
            "--pid", str(self.home / f"{name}.pid"),  # the default pid file is one per AIRFLOW_HOME
        ]  # fmt: skip
        self.workers[name] = subprocess.Popen(
            args, env=self.worker_env(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self.workers[name]

    def wait_worker_ready(self, name: str, timeout: float = budget(30)) -> None:
        """Until the worker has connected to the broker and listens on its queues (Celery logs "ready")."""
        log = self.home / f"{name}.log"
        self.wait_until(lambda: f"celery@{name} ready" in log.read_text(errors="replace"), timeout, f"{name} ready")

    def worker_of(self, pid: int) -> str | None:
        """The name of the Celery worker that ``pid`` (a task process, say) belongs to, while it runs."""
        sid = session_of(pid)
        return next((name for name, proc in self.workers.items() if proc.pid == sid), None)

    def kill_worker(self, name: str, timeout: float = budget(5)) -> list[int]:
        """SIGKILL the worker ``name`` and every process of its session: the Celery parent, its pool children,
        the task supervisors and the task processes (each task process has a process group of its own, so
        the worker's process group alone would miss them). Nothing gets to report anything. Returns the pids."""
        proc = self.workers[name]
        self.killed_workers.add(name)
        pids = session_pids(proc.pid)
        self.killed_ports[name] = tcp_client_ports(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=timeout)
        self.wait_until(
            lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), timeout, f"{name} to die", interval=0.1
        )
        return pids

    def wait_healthy(self, timeout: float) -> None:
        import requests

        wanted = {"metadatabase", "scheduler"} | {
            {"triggerer": "triggerer", "dag-processor": "dag_processor"}[c]
            for c in self.components
            if c in ("triggerer", "dag-processor")
        }
        last: dict[str, Any] = {}

        def healthy() -> bool:
            try:
                last.update(requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=10).json())
            except ValueError:  # not JSON yet: the server is still starting
                return False
            return all((last.get(k) or {}).get("status") == "healthy" for k in wanted)

        try:
            self.wait_until(healthy, timeout, f"Airflow to be healthy ({', '.join(sorted(wanted))})")
        except DeploymentTimeout as exc:
            raise DeploymentTimeout(f"the last health report: {last}\n{exc}") from None

    def wait_sessions_settled(self, ports: set[int], since: Any, timeout: float = budget(5)) -> int:
        """Until PostgreSQL has finished what killed clients (TCP ``ports``, sessions started before ``since``)
        had sent: a commit already sent completes after the kill, then the session ends. A session waiting for
        a lock ends only once the lock is released, so it is let be. Returns how many of those wait."""
        import psycopg2

        def settled() -> list[int] | None:
            conn = psycopg2.connect(self.target_dsn, connect_timeout=10)
            try:
                with conn.cursor() as cur:
                    cur.execute(
                        "SELECT count(*) FILTER (WHERE wait_event_type IS DISTINCT FROM 'Lock'),"
                        " count(*) FILTER (WHERE wait_event_type = 'Lock')"
                        " FROM pg_stat_activity WHERE datname = current_database()"
                        " AND client_port = ANY(%s) AND backend_start < %s",
                        (sorted(ports), since),
                    )
                    busy, waiting = cur.fetchone()
                    return None if busy else [waiting]
            finally:
                conn.close()

        (waiting,) = self.wait_until(settled, timeout, f"the sessions of {len(ports)} killed client sockets to end")
        return int(waiting)

    def _check_alive(self) -> None:
        alive = {**self.processes, **{n: p for n, p in self.workers.items() if n not in self.killed_workers}}
        for name, proc in alive.items():
            if proc.poll() is not None:
                self.failed = True
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.diagnostics()}")

    def stop(self) -> None:
        everything = [*self.workers.values(), *self.processes.values()]
        for proc in everything:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for proc in everything:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._kill_leftovers()
        if self.broker_url:
            release_redis_db(self.broker_url)
        admin_execute(self.server_dsn, f'DROP DATABASE IF EXISTS "{self.metadata_db}" WITH (FORCE)')
        if self.failed:
            print(f"\nAirflow component logs kept in {self.home}", file=sys.stderr)
        else:
            shutil.rmtree(self.home, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Task processes started by a component outlive it in their own sessions; find them by home."""
        marker = f"AIRFLOW_HOME={self.home}".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                if marker in (pid_dir / "environ").read_bytes():
                    os.kill(int(pid_dir.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    def __enter__(self) -> Deployment:
        try:
            return self.start()
        except BaseException:
            self.failed = True
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.failed = True
        self.stop()

    # -- the REST API, authenticated as the UI is -------------------------------------------------------

    @property
    def admin_password(self) -> str:
        data = json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())
        return str(data["admin"])

    def token(self) -> str:
        import requests

        if self._token is None:
            response = requests.post(
                f"{self.base_url}/auth/token",
                json={"username": "admin", "password": self.admin_password},
                timeout=30,
            )
            response.raise_for_status()
            self._token = response.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        # A busy api-server may drop or time out a request: repeat those that can be repeated (GET, PATCH).
        idempotent = method in ("GET", "PATCH")
        deadline = time.monotonic() + budget(15)
        while True:
            try:
                response = requests.request(
                    method,
                    f"{self.base_url}/api/v2{path}",
                    headers={"Authorization": f"Bearer {self.token()}"},
                    timeout=60,
                    **kwargs,
                )
            except (requests.ConnectionError, requests.Timeout):
                if not idempotent or time.monotonic() > deadline:
                    raise
                time.sleep(1)
                continue
            if response.status_code < 500 or not idempotent or time.monotonic() > deadline:
                break
            time.sleep(1)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    def wait_for_dag(self, dag_id: str, timeout: float = budget(30)) -> dict[str, Any]:
        return self.wait_until(lambda: self._dag_or_none(dag_id), timeout, f"DAG {dag_id} to be parsed")

    def _dag_or_none(self, dag_id: str) -> dict[str, Any] | None:
        try:
            return self.api("GET", f"/dags/{dag_id}")
        except RuntimeError:
            return None

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def pause(self, dag_id: str) -> None:
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": True})

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns", params={"order_by": "logical_date", "limit": 100})["dag_runs"]

    def wait_for_runs(
        self, dag_id: str, done: Callable[[list[dict[str, Any]]], bool], timeout: float = budget(60)
    ) -> list[dict[str, Any]]:
        """Poll the dag runs until ``done(runs)``; runs are dicts of the REST API."""

        def check() -> list[dict[str, Any]] | None:
            runs = self.runs(dag_id)
            return runs if done(runs) else None

        return self.wait_until(check, timeout, f"runs of {dag_id}")

    def wait_until(self, probe: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
        """Poll ``probe`` every ``interval`` seconds until it returns something true, and return that. A probe
        that meets a transient error (a request or connection timed out) is polled again. After ``timeout``
        seconds: DeploymentTimeout with the diagnostics. Each wait's time is kept in ``waits`` (and WAIT_LOG)."""
        started = time.monotonic()
        deadline = started + timeout
        last_error: BaseException | None = None
        transient = transient_errors()
        while True:
            self._check_alive()
            try:
                value = probe()
            except transient as exc:
                value, last_error = None, exc
            if value:
                self._record(what, time.monotonic() - started, timeout, ok=True)
                return value
            if time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
        self.failed = True
        self._record(what, time.monotonic() - started, timeout, ok=False)
        error = f"; the last poll failed with {last_error!r}" if last_error else ""
        raise DeploymentTimeout(f"timed out after {timeout:.0f}s waiting for {what}{error}\n{self.diagnostics()}")

    def _record(self, what: str, seconds: float, timeout: float, *, ok: bool) -> None:
        entry = {"what": what[:120], "seconds": round(seconds, 2), "budget": round(timeout), "ok": ok}
        self.waits.append(entry)
        if WAIT_LOG:
            with open(WAIT_LOG, "a") as log:
                log.write(json.dumps(entry) + "\n")

    # -- diagnostics -----------------------------------------------------------------------------------

    def diagnostics(self) -> str:
        """What the deployment was doing: the machine's load, the task instances of the latest runs (metadata
        database), the sessions of the target and metadata databases, and the end of each process's log."""
        import psycopg2

        parts = [f"== deployment diagnostics (logs kept in {self.home}); load average {os.getloadavg()}"]
        for title, section in (
            ("task instances of the latest runs", self._task_states),
            ("pg_stat_activity: the target database, the metadata database's busy sessions", self._activity),
        ):
            try:
                parts.append(f"== {title}\n{section()}")
            except (psycopg2.Error, OSError) as exc:  # diagnostics must never hide the failure they explain
                parts.append(f"== {title}: unavailable ({exc!r})")
        for name in [*self.processes, *self.workers]:
            parts.append(f"== last {LOG_TAIL} lines of {name}.log\n{self._tail(self.home / f'{name}.log')}")
        return "\n".join(parts)

    @staticmethod
    def _tail(path: Path, lines: int = LOG_TAIL) -> str:
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(unreadable: {exc})"
        return "\n".join(line[:400] for line in text)

    def _query(self, dbname: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        import psycopg2
        from psycopg2.extensions import make_dsn

        conn = psycopg2.connect(make_dsn(self.server_dsn, dbname=dbname, connect_timeout=10))
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SET statement_timeout = '20s'")
                cur.execute(sql, params)
                return cur.fetchall()
        finally:
            conn.close()

    def _task_states(self) -> str:
        runs = self._query(
            self.metadata_db,
            "SELECT dag_id, run_id, state, run_type FROM dag_run ORDER BY id DESC LIMIT 8",
        )
        out = []
        for dag_id, run_id, state, run_type in runs:
            out.append(f"{dag_id} / {run_id} ({run_type}): {state}")
            for task_id, ti_state, count, tries, hosts in self._query(
                self.metadata_db,
                "SELECT task_id, coalesce(state, 'none'), count(*), max(try_number),"
                " string_agg(DISTINCT hostname, ',') FROM task_instance WHERE dag_id = %s AND run_id = %s"
                " GROUP BY 1, 2 ORDER BY 1, 2",
                (dag_id, run_id),
            ):
                out.append(f"    {task_id}: {count} {ti_state} (max try {tries}; hosts {hosts or '-'})")
        unfinished = self._query(
            self.metadata_db,
            "SELECT dag_id, task_id, map_index, state, try_number, hostname, pid, queued_dttm, start_date"
            " FROM task_instance WHERE state IN ('queued', 'scheduled', 'running', 'up_for_retry', 'restarting',"
            " 'deferred') ORDER BY queued_dttm NULLS LAST LIMIT 20",
        )
        out += ["unfinished task instances:"] + [f"    {row}" for row in unfinished]
        return "\n".join(out)

    def _activity(self) -> str:
        from psycopg2.extensions import parse_dsn

        target = parse_dsn(self.target_dsn).get("dbname")
        rows = self._query(
            self.metadata_db,
            "SELECT datname, pid, client_port, application_name, state, wait_event_type, wait_event,"
            " round(extract(epoch FROM now() - xact_start)::numeric, 1) AS xact_s, left(query, 160)"
            " FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (datname = %s OR (datname = %s AND state <> 'idle'))"  # the metadata's idle pool is noise
            " ORDER BY datname, xact_start NULLS LAST LIMIT 60",
            (target, self.metadata_db),
        )
        return "\n".join(f"    {row}" for row in rows) or "    (no sessions)"
