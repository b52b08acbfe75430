"""What a task of a policy reads from its Airflow context: the date its run stands for, the cutoff frozen
from that date, and who runs this try (recorded in the ledger)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from airflow_retention.core.ledger.records import Attempt
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_anchor
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import default_host

if TYPE_CHECKING:
    from airflow.sdk import Context


def anchor_from_context(context: Context) -> datetime:
    """The instant the run stands for: its data interval end, else logical date, else run_after."""
    return run_anchor(
        data_interval_end=context.get("data_interval_end"),
        logical_date=context.get("logical_date"),
        run_after=getattr(context.get("dag_run"), "run_after", None),
    )


def cutoff_from_context(policy: RetentionPolicy, context: Context) -> datetime:
    """The run's frozen cutoff: its data interval end, else logical date, else run_after, minus retention."""
    return freeze_cutoff(policy, anchor_from_context(context))


def attempt_from_context(context: Context) -> Attempt:
    """Who runs this try: recorded in the ledger as ``<Airflow's hostname for the TI>:<pid>`` (Airflow's
    ``[core] hostname_callable`` names Celery workers apart even on one machine)."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", None)
    return Attempt(
        dag_id=ti.dag_id,
        run_id=ti.run_id,
        map_index=map_index if map_index is not None and map_index >= 0 else None,
        try_number=getattr(ti, "try_number", None),
        host=default_host(getattr(ti, "hostname", None)),
    )
