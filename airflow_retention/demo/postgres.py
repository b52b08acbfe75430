"""Find a PostgreSQL to work on: the DSN given, else the local server, else a throwaway embedded one."""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
from typing import Any

log = logging.getLogger(__name__)

DSN_ENV = "RETENTION_TEST_DSN"
# The maintenance database: every server has it. Callers work in databases of their own that they create.
LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_embedded: Any = None


def can_connect(dsn: str, timeout: int = 3) -> bool:
    import psycopg2

    try:
        psycopg2.connect(dsn, connect_timeout=timeout).close()
    except psycopg2.OperationalError:
        return False
    return True


def resolve_dsn(explicit: str | None = None) -> str:
    """``explicit`` or ``$RETENTION_TEST_DSN`` when given (it must answer), else the local server at
    127.0.0.1:5432 (database ``postgres``, to create databases from), else a throwaway server started
    with the ``pgserver`` package (stopped and removed at exit)."""
    given = explicit or os.environ.get(DSN_ENV)
    if given:
        if not can_connect(given):
            raise RuntimeError(f"PostgreSQL at {given!r} (from {DSN_ENV} or --dsn) does not answer")
        return given
    if can_connect(LOCAL_DSN):
        return LOCAL_DSN
    return start_embedded()


def sqlalchemy_url(dsn: str) -> str:
    """A psycopg2 SQLAlchemy URL for a libpq DSN (TCP or Unix socket)."""
    from urllib.parse import quote

    from psycopg2.extensions import parse_dsn

    p = parse_dsn(dsn)
    auth = quote(p.get("user", "postgres")) + (f":{quote(p['password'])}" if p.get("password") else "")
    host = p.get("host", "127.0.0.1")
    if host.startswith("/"):
        return f"postgresql+psycopg2://{auth}@/{p.get('dbname', 'postgres')}?host={quote(host)}"
    return f"postgresql+psycopg2://{auth}@{host}:{p.get('port', 5432)}/{p.get('dbname', 'postgres')}"


def admin_execute(server_dsn: str, *statements: str) -> None:
    """Run statements that cannot run in a transaction (CREATE / DROP DATABASE) on the server."""
    import psycopg2

    conn = psycopg2.connect(server_dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


def restart_server(dsn: str) -> None:
    """Restart the PostgreSQL server behind ``dsn``, for the database-fault drills: the throwaway server
    started here, or a Debian cluster of this machine (``pg_ctlcluster``). Anything else raises."""
    import shutil
    import subprocess

    from psycopg2.extensions import parse_dsn

    if _embedded is not None and _server(dsn) == _server(_embedded.get_uri()):
        from pgserver import _commands

        _commands.pg_ctl(["-w", "restart"], pgdata=_embedded.pgdata, user=_embedded.system_user, timeout=60)
        return
    parts = parse_dsn(dsn)
    host, port = parts.get("host", "localhost"), str(parts.get("port", "5432"))
    if not (host.startswith("/") or host in ("localhost", "127.0.0.1", "::1")):
        raise RuntimeError(f"refusing to restart PostgreSQL at {host}: only a server on this machine")
    if shutil.which("pg_lsclusters"):
        for line in subprocess.run(
            ["pg_lsclusters", "-h"], capture_output=True, text=True, check=True
        ).stdout.splitlines():
            version, cluster, cluster_port, *_ = line.split()
            if cluster_port == port:
                subprocess.run(
                    ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, "restart"],
                    check=True,
                    timeout=120,
                )
                return
    raise RuntimeError(f"cannot restart the PostgreSQL server of {dsn!r} from this process")


def _server(dsn: str) -> tuple[str, str]:
    """Host and port: the server, whichever of its databases the DSN names."""
    from psycopg2.extensions import parse_dsn

    parts = parse_dsn(dsn)
    return parts.get("host", "localhost"), str(parts.get("port", "5432"))


def start_embedded() -> str:
    global _embedded
    if _embedded is None:
        try:
            import pgserver
        except ImportError as exc:  # pragma: no cover - pgserver is in the test extra
            raise RuntimeError(
                f"no PostgreSQL at {LOCAL_DSN} and no {DSN_ENV} given; install pgserver for a throwaway one"
            ) from exc
        data_dir = tempfile.mkdtemp(prefix="retention-pg-")
        log.warning("no PostgreSQL at %s: starting a throwaway server in %s", LOCAL_DSN, data_dir)
        _embedded = pgserver.get_server(data_dir, cleanup_mode="delete")
        atexit.register(_embedded.cleanup)
    return _embedded.get_uri()


def airflow_connection_json(dsn: str) -> str:
    """The DSN as an Airflow connection in JSON (works for TCP and Unix-socket DSNs alike)."""
    import json

    from psycopg2.extensions import parse_dsn

    parts = parse_dsn(dsn)
    conn = {
        "conn_type": "postgres",
        "host": parts.get("host", "127.0.0.1"),
        "port": int(parts.get("port", 5432)),
        "login": parts.get("user", "postgres"),
        "password": parts.get("password") or None,
        "schema": parts.get("dbname", "postgres"),
    }
    return json.dumps(conn)
