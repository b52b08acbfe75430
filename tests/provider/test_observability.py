"""What an operator sees of a run besides the table: metrics through Airflow's Stats (a real StatsD
client sending real UDP packets), the cleanup lag the verify task stores in the ledger, and the VACUUM
after a large purge."""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.running import verify
from tests.provider.conftest import TEST_POLICIES, load_dag, query, task_instances, utc

pytestmark = pytest.mark.airflow


def policy(name: str) -> Any:
    return next(p for p in load_policies(TEST_POLICIES) if p.name == name)


def ledger_run(conn: Any, name: str, day: str) -> dict[str, Any]:
    p = policy(name)
    run = Ledger(p.ledger_schema).get_run(conn, run_key(p, freeze_cutoff(p, utc(day))))
    assert run is not None
    return run


@pytest.fixture
def statsd() -> Iterator[socket.socket]:
    """A UDP socket standing in for a StatsD server, and Airflow's Stats pointed at it (as the task
    runner does at start-up from ``[metrics]``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    env = {
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(sock.getsockname()[1]),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _configure_stats()
    try:
        yield sock
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _configure_stats()
        sock.close()


def _configure_stats() -> None:
    """Make Airflow's Stats pick its logger again from ``[metrics]`` (the environment)."""
    try:  # Airflow 3.2+
        from airflow.sdk.observability import stats
        from airflow.sdk.observability.metrics import stats_utils
    except ImportError:  # Airflow 3.0, 3.1: airflow.stats.Stats chooses its factory once, at import
        from airflow.metrics import statsd_logger
        from airflow.metrics.base_stats_logger import NoStatsLogger
        from airflow.stats import Stats

        on = os.environ.get("AIRFLOW__METRICS__STATSD_ON") == "True"
        type(Stats).factory = statsd_logger.get_statsd_logger if on else NoStatsLogger
        Stats.instance = None
        return
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)


def received(sock: socket.socket) -> dict[str, list[tuple[float, str]]]:
    """StatsD lines by metric name: value and type (c, ms, g)."""
    out: dict[str, list[tuple[float, str]]] = defaultdict(list)
    while True:
        try:
            data = sock.recv(65536).decode()
        except TimeoutError:
            return out
        for line in data.splitlines():
            name, rest = line.split(":", 1)
            value, kind = rest.split("|")[:2]
            out[name].append((float(value), kind))


def test_a_run_sends_its_metrics_through_airflow_stats(target: Any, statsd: socket.socket) -> None:
    day = "2026-02-05"
    dag_run = load_dag("retention_t_orders").test(logical_date=utc(day))
    assert dag_run.state == "success"
    run = ledger_run(target, "t_orders", day)
    metrics = received(statsd)
    deleted = metrics["airflow.retention.rows_deleted.t_orders"]
    assert deleted and {k for _, k in deleted} == {"c"}
    assert sum(v for v, _ in deleted) == run["rows_deleted"] > 0
    batches = metrics["airflow.retention.batch_seconds.t_orders"]
    assert len(batches) == len(deleted) and {k for _, k in batches} == {"ms"}
    assert all(v >= 0 for v, _ in batches)
    chunks = metrics["airflow.retention.chunks_completed.t_orders"]
    assert sum(v for v, _ in chunks) == run["chunks_expected"]
    assert metrics["airflow.retention.cleanup_lag_seconds.t_orders"] == [(0.0, "g")]
    assert metrics["airflow.retention.eligible_left.t_orders"] == [(0.0, "g")]
    # The database budget as the verify task found it, and the cleanup SLO it logged: one daily run that left
    # nothing, so λ is its rows per day and it keeps up.
    ((concurrency, duty, paused),) = query(
        target, f'SELECT concurrency, duty, paused FROM "{policy("t_orders").ledger_schema}".budget_state'
    )
    assert metrics["airflow.retention.budget_concurrency.t_orders"] == [(float(concurrency), "g")]
    assert metrics["airflow.retention.budget_duty.t_orders"] == [(float(duty), "g")]
    assert metrics["airflow.retention.budget_paused.t_orders"] == [(1.0 if paused else 0.0, "g")]
    assert metrics["airflow.retention.slo_keeps_up.t_orders"] == [(1.0, "g")]
    assert metrics["airflow.retention.slo_lambda_rows_per_day.t_orders"] == [(float(run["rows_deleted"]), "g")]
    (floor,) = metrics["airflow.retention.budget_floor_share.t_orders"]
    assert 0 <= floor[0] <= 1 and floor[1] == "g"
    # Pauses per reason: what the chunks recorded in the ledger, in milliseconds (each chunk's rounded).
    by_reason = dict(
        query(
            target,
            f'SELECT d.key, sum(d.value::float8) FROM "{policy("t_orders").ledger_schema}".chunks c,'
            " jsonb_each_text(c.paused) d WHERE c.run_key = %(k)s GROUP BY d.key",
            {"k": run["run_key"]},
        )
    )
    prefix = "airflow.retention.paused_ms_"
    sent = {n[len(prefix) : -len(".t_orders")]: values for n, values in metrics.items() if n.startswith(prefix)}
    assert set(sent) == {reason for reason, seconds in by_reason.items() if seconds >= 0.0005}
    for reason, values in sent.items():
        assert {k for _, k in values} == {"c"}
        assert sum(v for v, _ in values) == pytest.approx(by_reason[reason] * 1000, abs=len(values))


def test_the_verify_task_stores_the_cleanup_lag(target: Any) -> None:
    day = "2026-02-05"
    assert load_dag("retention_t_orders").test(logical_date=utc(day)).state == "success"
    run = ledger_run(target, "t_orders", day)
    assert (run["eligible_left"], run["cleanup_lag_seconds"], run["oldest_eligible_at"]) == (0, 0.0, None)
    assert run["lag_measured_at"] is not None

    # A dry run leaves every eligible row: the lag is the age of the oldest at the cutoff.
    assert load_dag("retention_t_audit_dry").test(logical_date=utc(day)).state == "success"
    dry = ledger_run(target, "t_audit_dry", day)
    cutoff = freeze_cutoff(policy("t_audit_dry"), utc(day))
    (left, oldest) = query(target, "SELECT count(*), min(at) FROM airflow_t.audit WHERE at < %s", (cutoff,))[0]
    assert left > 0
    assert (dry["eligible_left"], dry["oldest_eligible_at"]) == (left, oldest)
    assert dry["cleanup_lag_seconds"] == pytest.approx((cutoff - oldest).total_seconds())


def test_a_large_run_leaves_its_cleanup_lag_to_the_next_runs_planning(target: Any, monkeypatch: Any) -> None:
    # Every run that deletes a row counts as large here (the threshold is 200,000 rows).
    monkeypatch.setattr(verify, "LAG_AT_VERIFY_ROWS", 0)
    dag = load_dag("retention_t_orders")
    first_day, next_day = "2026-02-05", "2026-02-06"
    assert dag.test(logical_date=utc(first_day)).state == "success"
    first = ledger_run(target, "t_orders", first_day)
    assert first["rows_deleted"] > 0 and first["lag_measured_at"] is None
    # Closed after its chunk went by: eligible, left by the first run, deleted by the next one.
    cutoff = freeze_cutoff(policy("t_orders"), utc(first_day))
    ((reopened_id, reopened),) = query(
        target,
        "UPDATE airflow_t.orders SET status = 'closed' WHERE id = (SELECT min(id) FROM airflow_t.orders"
        " WHERE status = 'open' AND created_at < %s) RETURNING id, created_at",
        (cutoff,),
    )

    assert dag.test(logical_date=utc(next_day)).state == "success"
    first = ledger_run(target, "t_orders", first_day)
    assert first["lag_measured_at"] is not None
    assert first["lag_measured_at"] < ledger_run(target, "t_orders", next_day)["planned_at"]
    assert (first["eligible_left"], first["oldest_eligible_at"]) == (1, reopened)
    assert first["cleanup_lag_seconds"] == pytest.approx((cutoff - reopened).total_seconds())
    assert query(target, "SELECT count(*) FROM airflow_t.orders WHERE id = %s", (reopened_id,)) == [(0,)]


def test_vacuum_runs_after_a_purge_over_the_threshold(target: Any) -> None:
    day = "2026-02-05"
    dag = load_dag("retention_t_audit_vacuum")
    assert "retention_t_audit_vacuum.vacuum" in dag.task_dict
    assert "retention_t_orders.vacuum" not in load_dag("retention_t_orders").task_dict
    before = query(target, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'airflow_t.audit'::regclass")
    dag_run = dag.test(logical_date=utc(day))
    assert dag_run.state == "success"
    assert {ti.task_id: ti.state for ti in task_instances(dag_run)}["retention_t_audit_vacuum.vacuum"] == "success"
    run = ledger_run(target, "t_audit_vacuum", day)
    assert run["rows_deleted"] > 0 and run["vacuumed_at"] is not None
    deadline = time.monotonic() + 10
    while True:  # the statistics reach pg_stat_user_tables asynchronously
        query(target, "SELECT pg_stat_clear_snapshot()")
        after = query(target, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'airflow_t.audit'::regclass")
        if after[0][0] > before[0][0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after[0][0] > before[0][0]

    # The same day again deletes nothing: below the threshold, no second VACUUM.
    assert dag.test(logical_date=utc(day)).state == "success"
    assert ledger_run(target, "t_audit_vacuum", day)["vacuumed_at"] == run["vacuumed_at"]
