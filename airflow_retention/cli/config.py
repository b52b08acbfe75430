"""Where the command finds its policies and its databases, without a running Airflow.

Policies come from a YAML file: ``--policies``, else ``$AIRFLOW_RETENTION_POLICIES``, else
``dags/retention_policies.yaml`` in the current directory. A policy's database is ``--dsn`` when given,
else its ``conn_id`` resolved as Airflow would from ``AIRFLOW_CONN_<CONN_ID>`` (JSON or URI form), else,
when Airflow is installed and configured, Airflow's own connection lookup (secrets backends, metadata
database).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from airflow_retention.cli.errors import CliError, first_line

log = logging.getLogger(__name__)

POLICIES_ENV = "AIRFLOW_RETENTION_POLICIES"
DEFAULT_POLICIES = Path("dags") / "retention_policies.yaml"
CONNECT_TIMEOUT_S = 5
# libpq parameters an Airflow connection's extra may carry; the rest of the extra (cursor, ...) is Airflow's.
_LIBPQ_EXTRA = {
    "dbname",
    "sslmode",
    "sslcert",
    "sslkey",
    "sslrootcert",
    "sslcrl",
    "sslpassword",
    "connect_timeout",
    "application_name",
    "options",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "target_session_attrs",
    "gssencmode",
    "client_encoding",
}


def policies_path(explicit: str | None) -> Path | None:
    """The policies file to read: the option, the environment variable, or the default if it exists."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(POLICIES_ENV)
    if env:
        return Path(env)
    return DEFAULT_POLICIES if DEFAULT_POLICIES.is_file() else None


def load_policies(explicit: str | None) -> list[Any]:
    """Every valid policy of the file; the bad ones are reported on stderr (the DAG file shows each as a
    failing DAG of its own) and left out. No file at all is an error."""
    return load_policy_file(explicit)[0]


def load_policy_file(explicit: str | None) -> tuple[list[Any], list[Any]]:
    """The valid policies of the file and the errors (``PolicyError``) of the bad ones, each also reported
    on stderr. No file at all, or one that cannot be read, is an error."""
    from airflow_retention.core.errors import PolicyError
    from airflow_retention.core.policy.loading import load_policies_lenient

    path = policies_path(explicit)
    if path is None:
        raise CliError(
            f"no policies file: give --policies PATH, set {POLICIES_ENV}, or run where {DEFAULT_POLICIES} exists"
        )
    metadata = _metadata_policies(path)
    if metadata is not None:
        return metadata, []
    try:
        policies, errors = load_policies_lenient(path)
    except PolicyError as exc:
        raise CliError(str(exc)) from None
    for error in errors:
        log.warning("%s: skipped %s", path, error)
    return policies, errors


def _metadata_policies(path: Path) -> list[Any] | None:
    """The policies of an ``init --airflow-metadata`` settings file (a top-level ``airflow_metadata:``),
    generated from the installed Airflow's cleanup configuration as the DAG file does; None for a
    policies file."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # the policies loader says what is wrong with the file
    if not isinstance(doc, dict) or "airflow_metadata" not in doc:
        return None
    if set(doc) != {"airflow_metadata"}:
        others = ", ".join(sorted(str(k) for k in doc if k != "airflow_metadata"))
        raise CliError(
            f"{path}: a file holds either policies (policies:, defaults:) or the metadata database's settings"
            f" (airflow_metadata:), not both; found also {others}"
        )
    if importlib.util.find_spec("airflow") is None:
        raise CliError(f"{path}: Airflow metadata settings need the installed Airflow (its db clean configuration)")
    from airflow_retention.metadata import metadata_policies, parse_settings

    try:
        return metadata_policies(parse_settings(doc, str(path)))
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from None


def select_policies(policies: Sequence[Any], names: Sequence[str]) -> list[Any]:
    """The policies named (all when none is), in the order given; an unknown name is an error that lists
    the known ones."""
    if not names:
        if not policies:
            raise CliError("the policies file holds no valid policy")
        return list(policies)
    by_name = {p.name: p for p in policies}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        known = ", ".join(sorted(by_name)) or "none"
        raise CliError(f"unknown policy {unknown[0]!r}; known policies: {known}")
    return [by_name[n] for n in names]


def dsn_from_airflow_json(text: str) -> str:
    """A libpq DSN from an Airflow connection in its JSON form (``conn_type``, ``host``, ``login``, ...)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CliError(f"connection JSON is not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise CliError("connection JSON must be an object")
    extra = data.get("extra") or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except ValueError:
            extra = {}
    return _make_dsn(
        host=data.get("host"),
        port=data.get("port"),
        user=data.get("login"),
        password=data.get("password"),
        dbname=data.get("schema"),
        extra=extra if isinstance(extra, Mapping) else {},
    )


def dsn_from_airflow_uri(uri: str) -> str:
    """A libpq DSN from an Airflow connection URI (``postgres://login:password@host:port/schema?extra``).
    Airflow percent-encodes every part, a Unix socket directory given as host included."""
    parts = urlsplit(uri)
    if parts.scheme.replace("-", "_") not in ("postgres", "postgresql"):
        raise CliError(f"connection URI has type {parts.scheme!r}; a Postgres connection is needed")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if "__extra__" in query:
        try:
            query = {**json.loads(query.pop("__extra__")), **query}
        except ValueError:
            query.pop("__extra__", None)
    try:
        port = parts.port
    except ValueError:
        raise CliError("connection URI has an invalid port") from None
    return _make_dsn(
        host=unquote(parts.hostname or "") or None,
        port=port,
        user=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        dbname=unquote(parts.path.lstrip("/")) or None,
        extra=query,
    )


def _make_dsn(*, host: Any, port: Any, user: Any, password: Any, dbname: Any, extra: Mapping[str, Any]) -> str:
    from psycopg2.extensions import make_dsn

    params = {k: str(v) for k, v in extra.items() if k in _LIBPQ_EXTRA and v is not None}
    for key, value in (("host", host), ("port", port), ("user", user), ("password", password), ("dbname", dbname)):
        if value not in (None, ""):
            params[key] = str(value)
    return make_dsn(**params)


def conn_env_var(conn_id: str) -> str:
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def dsn_for_conn_id(conn_id: str) -> str:
    """The DSN of an Airflow connection id, from ``AIRFLOW_CONN_<ID>`` or, failing that, from Airflow."""
    value = os.environ.get(conn_env_var(conn_id))
    if value:
        value = value.strip()
        return dsn_from_airflow_json(value) if value.startswith("{") else dsn_from_airflow_uri(value)
    dsn = dsn_from_airflow(conn_id)
    if dsn is None:
        raise CliError(f"connection {conn_id!r} is not defined: give --dsn, or set {conn_env_var(conn_id)}")
    return dsn


def airflow_configured() -> bool:
    """Airflow is installed and points at a configuration: only then is asking it worth its import time."""
    if importlib.util.find_spec("airflow") is None:
        return False
    home = Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")
    return bool(os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")) or (home / "airflow.cfg").is_file()


def dsn_from_airflow(conn_id: str) -> str | None:
    """Ask Airflow (secrets backends, then the metadata database) for the connection; None when Airflow is
    not there or does not know it."""
    if not airflow_configured():
        return None
    conn = None
    try:
        from airflow.sdk import Connection

        conn = Connection.get(conn_id)
    except Exception:  # outside a task the SDK lookup may not be available
        log.debug("airflow.sdk Connection.get(%s) failed", conn_id, exc_info=True)
    if conn is None:
        try:
            from airflow.models.connection import Connection as ModelConnection

            conn = ModelConnection.get_connection_from_secrets(conn_id)
        except Exception:  # not found, no metadata database, a misconfigured Airflow
            log.debug("Connection.get_connection_from_secrets(%s) failed", conn_id, exc_info=True)
            return None
    return _make_dsn(
        host=conn.host,
        port=conn.port,
        user=conn.login,
        password=conn.password,
        dbname=conn.schema,
        extra=conn.extra_dejson or {},
    )


# The libpq parameters whose values are secrets: those libpq itself marks "*" (hidden) in PQconndefaults():
# password, sslpassword (the client key's passphrase) and, from libpq 18, oauth_client_secret. sslkey,
# sslcert and passfile are paths, not secrets.
SECRET_DSN_PARAMETERS = frozenset({"password", "sslpassword", "oauth_client_secret"})


def redact(dsn: str) -> str:
    """The DSN without its secrets (:data:`SECRET_DSN_PARAMETERS`), for messages."""
    from psycopg2.extensions import parse_dsn

    try:
        parts = parse_dsn(dsn)
    except Exception:  # noqa: BLE001 - a DSN libpq cannot parse is shown as nothing but its shape
        return "<unparsable DSN>"
    return " ".join(f"{k}={v}" for k, v in parts.items() if k not in SECRET_DSN_PARAMETERS)


@dataclass(frozen=True)
class Target:
    """A database and a ledger schema in it, as the command reaches them."""

    dsn: str
    schema: str

    @property
    def label(self) -> str:
        return f"{redact(self.dsn)} schema {self.schema}"


def target_for(policy: Any, dsn: str | None) -> Target:
    return Target(dsn=dsn or dsn_for_conn_id(policy.conn_id), schema=policy.ledger_schema)


@contextmanager
def connect(dsn: str) -> Iterator[Any]:
    """A psycopg2 connection, closed afterwards; an unreachable server is a one-line error."""
    import psycopg2

    try:
        conn = psycopg2.connect(dsn, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg2.Error as exc:
        raise CliError(f"cannot connect to PostgreSQL ({redact(dsn)}): {first_line(exc)}") from None
    try:
        yield conn
    finally:
        conn.close()
