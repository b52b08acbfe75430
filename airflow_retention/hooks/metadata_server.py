"""Airflow's metadata database when it lives on the target's PostgreSQL server.

Its sessions (the scheduler's, the API server's, the triggerer's) are always at work: counted as an
application by the database budget, they would start every purge slow and make the WAL rate count on an
otherwise idle server, where a purge's own WAL then holds it at the floor. The chunk tasks add it to the
policy's ``budget.ignore_databases``; the canary still measures whatever Airflow's sessions cost.
"""

from __future__ import annotations

import dataclasses
import logging

from airflow_retention.core.policy.model import RetentionPolicy

log = logging.getLogger(__name__)

# Host names that all reach this machine's server: a socket directory is the same server too.
_LOCAL = {"", "localhost", "127.0.0.1", "::1"}
DEFAULT_PORT = 5432


def _server(host: str | None, port: int | str | None) -> tuple[str, int]:
    name = (host or "").strip().lower()
    return ("local" if name in _LOCAL or name.startswith("/") else name, int(port or DEFAULT_PORT))


def metadata_database_on(host: str | None, port: int | str | None, url: str | None = None) -> str | None:
    """The name of Airflow's metadata database when it is a PostgreSQL database on the server at ``host``
    and ``port`` (the target's connection), else None.

    :param url: the metadata database's SQLAlchemy URL; by default ``[database] sql_alchemy_conn``, which a
        worker may not have (then None: nothing is ignored).
    """
    if url is None:
        try:
            from airflow.configuration import conf

            url = conf.get("database", "sql_alchemy_conn", fallback=None)
        except Exception:  # noqa: BLE001 - a worker without the metadata database's settings
            return None
    if not url:
        return None
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: not one to compare
        return None
    if not parsed.drivername.startswith("postgres") or not parsed.database:
        return None
    try:
        same = _server(parsed.host, parsed.port) == _server(host, port)
    except ValueError:  # a port that is not a number
        return None
    return parsed.database if same else None


def ignoring_metadata(
    policy: RetentionPolicy, host: str | None, port: int | str | None, database: str | None = None
) -> RetentionPolicy:
    """``policy`` with Airflow's metadata database in ``budget.ignore_databases`` when it is on the
    target's server (``host``, ``port``) and the budget is on; else ``policy`` itself. Not when it is the
    target's own ``database``: a purge of Airflow's metadata (``db clean``'s tables) yields to the
    scheduler working in it."""
    budget = policy.budget
    if not budget.enabled:
        return policy
    name = metadata_database_on(host, port)
    if name is None or name in budget.ignore_databases or name == database:
        return policy
    log.info(
        "Airflow's metadata database %s is on the target's server: the database budget does not count its"
        " sessions as an application to yield to (budget.ignore_databases)",
        name,
    )
    ignored = dataclasses.replace(budget, ignore_databases=(*budget.ignore_databases, name))
    return dataclasses.replace(policy, budget=ignored)
