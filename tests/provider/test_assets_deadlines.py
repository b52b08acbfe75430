"""Issue 33: a policy's table as an Airflow asset, and its cleanup window as a deadline alert.

The DAG of ``t_audit_asset`` (tests/provider/dags/asset_dags.py) is run by a real Airflow 3 (``dag.test()``)
against the real PostgreSQL; the report DAG of the same file is scheduled on its asset. What is asserted in
the metadata database afterwards: the asset event with the run's totals as its ``extra``, the report DAG
queued for it (an ``AssetDagRunQueue`` row, and the scheduler's own query, ``dags_needing_dagruns``, naming it
due: the next scheduler loop creates its run), and, on Airflow 3.1+, the run's ``deadline`` row, missed since
the run's date is in the past, handled as the scheduler does (``handle_miss``) and its callback run as the
triggerer runs it (``CallbackTrigger``): the ERROR line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import timedelta
from typing import Any

import pytest

from airflow_retention import deadlines
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.model import RetentionPolicy
from tests.conftest import E2E_DB
from tests.provider.conftest import load_dag, utc
from tests.provider.dag_sync import sync_test_dags

pytestmark = pytest.mark.airflow

POLICY = RetentionPolicy(
    name="t_shape_asset",
    conn_id="retention_target",
    table="airflow_t.audit",
    key_column="id",
    timestamp_column="at",
    retention="10 days",
    asset=True,
    cleanup_window="24h",
)


def expected_uri() -> str:
    from airflow.sdk import Connection

    conn = Connection.get("retention_target")
    return f"postgres://{conn.host}:{conn.port}/{E2E_DB}/airflow_t/audit"


def test_the_verify_task_carries_the_asset_and_sets_its_extra() -> None:
    from airflow.sdk import Asset

    from airflow_retention.assets import RunEventExtra
    from airflow_retention.dag_factory import build_dag

    seen: list[Any] = []
    dag = build_dag(POLICY, sensor_kwargs={"post_execute": lambda context, result: seen.append(result)})
    verify = dag.task_dict["retention_t_shape_asset.verify"]
    assert verify.outlets == [Asset(expected_uri())]
    hook = verify._post_execute_hook
    assert isinstance(hook, RunEventExtra)

    from airflow.sdk.execution_time.context import OutletEventAccessors

    context = {"outlet_events": OutletEventAccessors()}
    hook(context, {"run_key": "k", "cutoff": "2026-01-10T00:00:00Z", "rows_deleted": 3, "rows_matched": 0, "chunks": 1})
    assert seen and seen[0]["run_key"] == "k"  # the caller's own post_execute ran too
    extra = context["outlet_events"][Asset(expected_uri())].extra
    assert extra == {
        "policy": "t_shape_asset",
        "table": "airflow_t.audit",
        "run_key": "k",
        "cutoff": "2026-01-10T00:00:00Z",
        "rows_deleted": 3,
        "rows_matched": 0,
        "chunks": 1,
        "dry_run": False,
    }
    assert not build_dag(dataclasses.replace(POLICY, asset=None)).task_dict["retention_t_shape_asset.verify"].outlets


def test_an_asset_whose_connection_cannot_be_read_shows_as_the_policys_error() -> None:
    from airflow_retention.dag_factory import build_dags

    dags = build_dags([dataclasses.replace(POLICY, conn_id="no_such_connection")])
    message = dags["retention_t_shape_asset"].description
    assert "field 'asset'" in message and "'no_such_connection'" in message and "give the URI" in message
    explicit = dataclasses.replace(POLICY, conn_id="no_such_connection", asset="postgres://db:5432/app/airflow_t/audit")
    verify = build_dags([explicit])["retention_t_shape_asset"].task_dict["retention_t_shape_asset.verify"]
    assert [a.uri for a in verify.outlets] == ["postgres://db:5432/app/airflow_t/audit"]  # no connection read


def test_the_cleanup_window_is_a_deadline_alert_of_the_dag() -> None:
    from airflow_retention.dag_factory import build_dag

    if not deadlines.DEADLINES_SUPPORTED:  # Airflow 3.0 (./dev oldest): no alerts, the DAG builds without one
        with pytest.raises(ImportError):
            import airflow.sdk.definitions.deadline  # noqa: F401
        assert not getattr(build_dag(POLICY), "deadline", None)
        return
    from airflow.sdk.definitions.deadline import AsyncCallback, DeadlineReference

    try:  # Airflow 3.3
        from airflow.serialization.serialized_objects import DagSerialization
    except ImportError:  # Airflow 3.1, 3.2
        from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization

    dag = build_dag(POLICY)
    alerts = dag.deadline if isinstance(dag.deadline, list) else [dag.deadline]
    (alert,) = alerts
    assert alert.reference == DeadlineReference.DAGRUN_LOGICAL_DATE
    assert alert.interval == timedelta(hours=24)
    assert alert.callback.path == deadlines.DEFAULT_CALLBACK
    assert alert.callback.kwargs == {"policy": "t_shape_asset", "table": "airflow_t.audit", "cleanup_window": "1 day"}
    (stored,) = DagSerialization.serialize_dag(dag)["deadline"]
    text = str(stored)
    assert "DagRunLogicalDateDeadline" in text and "86400" in text and deadlines.DEFAULT_CALLBACK in text

    async def page(**kwargs: Any) -> None:  # a user's own callback (a notifier's place)
        return None

    mine = AsyncCallback("tests.provider.test_assets_deadlines.page_oncall", kwargs={"team": "db"})
    (alert,) = build_dag(POLICY, deadline_callback=mine).deadline
    assert alert.callback is mine
    (alert,) = build_dag(POLICY, deadline_callback="tests.provider.test_assets_deadlines.page_oncall").deadline
    assert alert.callback.path == "tests.provider.test_assets_deadlines.page_oncall"
    explicit = build_dag(POLICY, deadline=deadlines.cleanup_deadline(dataclasses.replace(POLICY, cleanup_window="2h")))
    assert [a.interval for a in explicit.deadline] == [timedelta(hours=2)]


async def page_oncall(**kwargs: Any) -> None:
    """A stand-in for a user's notifier (importable by path, as Airflow stores callbacks)."""


def test_without_deadline_alerts_the_window_warns_once_and_the_dag_builds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Airflow 3.0's behaviour, on any Airflow: the feature flag off."""
    from airflow_retention.dag_factory import build_dag

    monkeypatch.setattr(deadlines, "DEADLINES_SUPPORTED", False)
    monkeypatch.setattr(deadlines, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="airflow_retention.deadlines"):
        first, second = build_dag(POLICY), build_dag(POLICY)
    assert not getattr(first, "deadline", None) and not getattr(second, "deadline", None)
    warned = [r.getMessage() for r in caplog.records if r.name == "airflow_retention.deadlines"]
    assert len(warned) == 1 and "cleanup_window 1 day is not enforced" in warned[0] and "3.1" in warned[0]
    with pytest.raises(ValueError, match=r"deadline= needs Airflow 3\.1"):
        build_dag(POLICY, deadline=object())


def test_the_default_callback_names_the_policy_the_run_and_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    context = {
        "dag_run": {"dag_run_id": "backfill__2026-01-02", "dag_id": "retention_events", "run_type": "backfill"},
        "deadline": {"deadline_time": "2026-01-03 00:00:00+00:00"},
    }
    kwargs = {"policy": "events", "table": "public.events", "cleanup_window": "1 day"}
    with caplog.at_level(logging.ERROR, logger="airflow_retention.deadlines"):
        line = asyncio.run(deadlines.log_missed_deadline(**kwargs, context=context))
    assert [r.getMessage() for r in caplog.records if r.name == "airflow_retention.deadlines"] == [line]
    assert line.startswith("retention policy events (public.events): DAG run backfill__2026-01-02 of retention_events")
    assert "backfill run" in line and "is not complete 1 day after its date" in line and "2026-01-03" in line


def test_a_completed_run_updates_the_asset_and_queues_the_report(target: Any) -> None:
    from airflow import settings
    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.models.dag import DagModel
    from sqlalchemy import select

    sync_test_dags()  # Airflow 3.0's dag.test() does not
    dag_run = load_dag("retention_t_audit_asset").test(logical_date=utc("2026-01-20"))
    assert dag_run.state == "success"
    run = Ledger("airflow_t_ledger").get_run(target, "t_audit_asset@2026-01-10T00:00:00Z")
    assert run is not None and run["state"] == "complete" and run["rows_deleted"] > 0

    session = settings.Session()
    asset = session.scalar(select(AssetModel).where(AssetModel.uri == expected_uri()))
    assert asset is not None
    (event,) = session.scalars(
        select(AssetEvent).where(AssetEvent.asset_id == asset.id, AssetEvent.source_run_id == dag_run.run_id)
    ).all()
    assert event.source_task_id == "retention_t_audit_asset.verify"
    assert event.extra == {
        "policy": "t_audit_asset",
        "table": "airflow_t.audit",
        "run_key": "t_audit_asset@2026-01-10T00:00:00Z",
        "cutoff": "2026-01-10T00:00:00Z",
        "rows_deleted": run["rows_deleted"],
        "rows_matched": 0,
        "chunks": run["chunks_completed"],
        "dry_run": False,
    }
    queued = session.scalars(select(AssetDagRunQueue.target_dag_id).where(AssetDagRunQueue.asset_id == asset.id)).all()
    assert "t_report_after_purge" in queued
    _, due = DagModel.dags_needing_dagruns(session)  # the scheduler's own query: this DAG gets a run next loop
    assert "t_report_after_purge" in due
    session.rollback()
    if deadlines.DEADLINES_SUPPORTED:  # every DAG of the folder is in the metadata DB now
        a_late_run_misses_its_deadline(session)


def a_late_run_misses_its_deadline(session: Any) -> None:
    """A scheduled run of ``t_audit_deadline`` (cleanup_window 24h), created as the scheduler creates it,
    from the serialized DAG, for a date long past: its deadline row says date + 24h, already missed. The
    scheduler would find it (``deadline_time < now``, not ``missed``) and call ``handle_miss``; the
    triggerer then runs the callback (``CallbackTrigger``). Not run by dag.test(): Airflow 3.3.2's
    dag.test() fails at the end of a DAG with a deadline (apache/airflow#73428)."""
    from airflow.models.deadline import Deadline
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.triggers.callback import CallbackTrigger
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    from sqlalchemy import select

    day = utc("2026-01-20")
    scheduler_dag = SerializedDagModel.get_dag("retention_t_audit_deadline", session=session)
    try:
        dag_run = scheduler_dag.create_dagrun(
            run_id="scheduled__2026-01-20T00:00:00+00:00",
            logical_date=day,
            data_interval=(day, day),
            run_after=day,
            run_type=DagRunType.SCHEDULED,
            triggered_by=DagRunTriggeredByType.TIMETABLE,
            state=DagRunState.QUEUED,
            session=session,
        )
        session.flush()  # Airflow's sessions do not autoflush
        (deadline,) = session.scalars(select(Deadline).where(Deadline.dagrun_id == dag_run.id)).all()
        assert deadline.deadline_time == day + timedelta(hours=24)
        assert deadline.missed is False
        deadline.handle_miss(session)
        assert deadline.missed is True
        data = dict(deadline.callback.data)
    finally:
        session.rollback()
    assert data["path"] == deadlines.DEFAULT_CALLBACK
    kwargs = data["kwargs"]
    assert (
        kwargs["policy"] == "t_audit_deadline"
        and kwargs["context"]["dag_run"]["dag_id"] == "retention_t_audit_deadline"
    )

    async def fire() -> list[Any]:
        return [event async for event in CallbackTrigger(data["path"], dict(kwargs)).run()]

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("airflow_retention.deadlines")
    logger.addHandler(handler)
    try:
        events = asyncio.run(fire())
    finally:
        logger.removeHandler(handler)
    assert [e.payload["state"] for e in events] == ["running", "success"], events
    (record,) = records
    assert record.levelno == logging.ERROR
    line = record.getMessage()
    assert "retention policy t_audit_deadline (airflow_t.audit)" in line
    assert "scheduled__2026-01-20" in line and "is not complete 1 day after its date" in line
