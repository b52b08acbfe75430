"""A policy's table as an Airflow asset (policy field ``asset``), and the event a completed run emits.

The asset's URI is the Postgres provider's form, ``postgres://host:port/database/schema/table``: the
same table that OpenLineage names ``database.schema.table`` in the namespace ``postgres://host:port``
(:mod:`airflow_retention.lineage`), so the two views of a run agree. The verify task, which marks the
run complete in the ledger, carries the asset as its outlet; when it succeeds, Airflow records one asset
event whose ``extra`` holds the run's totals (:func:`run_event_extra`), and DAGs scheduled on the asset
run after it (docs/lineage.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from airflow.sdk import Asset, Connection

from airflow_retention.core.policy.model import RetentionPolicy


def asset_uri(policy: RetentionPolicy, connection: Any = None) -> str:
    """The URI of the policy's asset: the URI the policy gives, or, with ``asset: true``, one made from the
    connection's host, port (default 5432) and database (its ``schema`` field) and the policy's table.

    :param connection: the policy's connection, when the caller has it; else it is looked up (in a DAG
        file, when the DAG is parsed).
    :raises ValueError: the policy has no asset, or its connection cannot be read or lacks a host or a
        database.
    """
    if isinstance(policy.asset, str):
        return policy.asset
    if policy.asset is not True:
        raise ValueError(f"policy {policy.name!r} declares no asset (field 'asset')")
    conn = connection
    if conn is None:
        try:
            conn = Connection.get(policy.conn_id)
        except Exception as exc:  # Airflow's not-found error differs between versions
            raise ValueError(
                f"policy {policy.name!r}, field 'asset': 'asset: true' names the asset from connection"
                f" {policy.conn_id!r} when the DAG is parsed, and it cannot be read ({exc}); create the"
                " connection, or give the URI: asset: postgres://host:5432/database/schema/table"
            ) from exc
    if not conn.host or not conn.schema:
        raise ValueError(
            f"policy {policy.name!r}, field 'asset': connection {policy.conn_id!r} names no host or no database"
            " (its schema field), which the asset's URI postgres://host:port/database/schema/table needs;"
            " complete the connection, or give the URI: asset: postgres://host:5432/database/schema/table"
        )
    table = policy.table
    path = "/".join(quote(part, safe="") for part in (conn.schema, str(table.schema), table.name))
    return f"postgres://{conn.host}:{conn.port or 5432}/{path}"


def policy_asset(policy: RetentionPolicy, connection: Any = None) -> Asset:
    """The policy's table as an ``Asset``, to schedule a DAG on it: ``schedule=[policy_asset(policy)]``.
    With ``asset: true`` it reads the connection (see :func:`asset_uri`)."""
    return Asset(asset_uri(policy, connection))


def run_event_extra(policy: RetentionPolicy, totals: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` of the asset event of a completed run, from the verify task's result: what a
    downstream DAG reads in ``triggering_asset_events``."""
    return {
        "policy": policy.name,
        "table": str(policy.table),
        "run_key": totals.get("run_key"),
        "cutoff": totals.get("cutoff"),
        "rows_deleted": totals.get("rows_deleted"),
        "rows_matched": totals.get("rows_matched"),
        "chunks": totals.get("chunks"),
        "dry_run": policy.dry_run,
    }


class RunEventExtra:
    """The verify task's ``post_execute`` hook when the policy has an asset: Airflow calls it with the
    task's context and result (the run's totals) after the run was marked complete, before it records
    the task's outlet events; it sets the asset event's ``extra``. A ``post_execute`` of the caller's
    (``sensor_kwargs``) runs first.

    Why a hook and not a task of its own: the event then comes from the task that marks the run complete,
    in its own success (no extra task, nor its half a second of scheduling, per run), in every mode of the
    sensor (a poke in the worker, a reschedule, a deferral: Airflow calls the hook after the resumed method
    too), and the sensor itself knows nothing of assets.
    """

    def __init__(self, asset: Asset, policy: RetentionPolicy, then: Callable[[Any, Any], Any] | None = None) -> None:
        self.asset = asset
        self.policy = policy
        self.then = then

    def __call__(self, context: Any, result: Any) -> None:
        if self.then is not None:
            self.then(context, result)
        if isinstance(result, Mapping):
            context["outlet_events"][self.asset].extra = run_event_extra(self.policy, result)
