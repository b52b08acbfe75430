"""The Retention view's data and pages against a real PostgreSQL ledger written by the core engine: the
numbers shown are the ledger's, a policy whose connection fails gets a message while the others still show,
and the view's sessions cannot write."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_retention.cli.config import target_for
from airflow_retention.cli.render import lag_text
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.postgres import airflow_connection_json
from airflow_retention.plugins.budget import STUCK, THROTTLED
from airflow_retention.plugins.data import PolicySet, ledger_session, load_panels, load_run
from airflow_retention.plugins.render import overview_page, run_page

from ..conftest import DSN
from ..core.helpers import FLOOR_DUTY
from .conftest import stopped
from .helpers import (
    CHUNK_ERROR,
    PAUSE_REASON,
    Seeded,
    ViewReader,
    ledger_chunks,
    ledger_pauses,
    ledger_runs,
    seed_budget_pressure,
    seed_runs,
    view_policy_data,
)

FIRST_ANCHOR = datetime(2024, 7, 1, tzinfo=timezone.utc)
AS_OF = datetime(2024, 7, 6, 0, 30, tzinfo=timezone.utc)  # the 5th's run is due and missing
SOURCE = Path("policies.yaml")


@pytest.fixture
def seeded(admin: Any, schema: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Seeded]:
    # Both connections are looked up as Airflow would: from AIRFLOW_CONN_<ID>.
    monkeypatch.setenv("AIRFLOW_CONN_VIEW_OK", airflow_connection_json(DSN))
    monkeypatch.setenv("AIRFLOW_CONN_VIEW_BROKEN", "postgres://postgres@127.0.0.1:1/nowhere")
    policy = RetentionPolicy.from_dict(view_policy_data(schema, "view_ok", FIRST_ANCHOR))
    conn = psycopg2.connect(DSN)
    try:
        yield seed_runs(admin, conn, schema, policy, FIRST_ANCHOR)
    finally:
        conn.close()


def broken_policy(schema: str) -> RetentionPolicy:
    return RetentionPolicy.from_dict(view_policy_data(schema, "view_broken", FIRST_ANCHOR, name="unreachable"))


def test_overview_shows_the_ledgers_numbers(seeded: Seeded, admin: Any, schema: str) -> None:
    policy = seeded.policy
    (panel,) = load_panels([policy], as_of=AS_OF)
    assert panel.error is None and panel.status is not None
    html = overview_page(PolicySet(SOURCE, [policy]), [panel], AS_OF)
    view = ViewReader(html)

    expected = ledger_runs(admin, policy.ledger_schema)
    assert set(expected) == {*seeded.complete, seeded.partial}
    assert set(view.rows) == set(expected)
    for key, want in expected.items():
        shown = view.rows[key]
        assert shown["chunks"] == want["chunks"], key
        assert int(shown["rows_deleted"]) == want["rows_deleted"], key
        assert view.bars[key] == want["rows_deleted"], key
        assert shown["cutoff"] == f"{want['cutoff'].astimezone(timezone.utc):%Y-%m-%d %H:%M:%S}Z"
        if want["cleanup_lag"] is None:
            assert shown["cleanup_lag"] == "" and key not in view.lag_points
        else:
            assert float(shown["cleanup_lag"]) == pytest.approx(want["cleanup_lag"])
            assert view.lag_points[key] == pytest.approx(want["cleanup_lag"], rel=1e-5)
    assert all(expected[k]["state"] == "complete" and view.rows[k]["state"] == "complete" for k in seeded.complete)
    assert view.rows[seeded.partial]["state"] == "planned"
    assert view.lag_points[seeded.partial] > 0  # rows were left eligible when it was measured
    assert sum(view.bars.values()) > 0

    # The second day's run never completed, but the fourth's (a later cutoff) did: nothing left for the
    # second's, it is covered. The fifth's was never run: its run could still delete rows, it is missed.
    assert [m.anchor for m in panel.status.missed] == [seeded.anchors[4]]
    assert [m.anchor for m in panel.status.covered] == [seeded.anchors[1]]
    (backfill,) = view.texts["backfill"]
    assert backfill == (
        "airflow backfill create --dag-id retention_events_purge"
        " --from-date 2024-07-05T00:00:00Z --to-date 2024-07-05T00:00:00Z"
    )
    (covered,) = view.texts["covered"]
    assert covered.startswith("1 scheduled day(s) from 2024-07-02 to 2024-07-02 have no complete run of their own")
    # The second day's chunk error is a warning: the latest run (the fourth's) completed, nothing is failing.
    assert f"chunk {seeded.failing_chunk} (pending): {CHUNK_ERROR}" in html
    assert "failing" not in view.texts and not view.alerts


def test_a_broken_connection_is_a_message_and_the_other_policies_still_show(seeded: Seeded, schema: str) -> None:
    broken = broken_policy(schema)
    undefined = RetentionPolicy.from_dict(view_policy_data(schema, "view_undefined", FIRST_ANCHOR, name="nowhere"))
    panels = load_panels([broken, seeded.policy, undefined], as_of=AS_OF)
    assert [p.policy.name for p in panels] == ["unreachable", "events_purge", "nowhere"]
    assert panels[0].status is None and panels[0].error == "the database of connection 'view_broken' cannot be reached"
    assert "cannot connect to PostgreSQL" in (panels[0].detail or "")
    assert panels[1].error is None and panels[1].status is not None and len(panels[1].status.runs) == 4
    assert panels[2].status is None and "connection 'view_undefined' is not defined" in (panels[2].detail or "")

    view = ViewReader(overview_page(PolicySet(SOURCE, [p.policy for p in panels]), panels, AS_OF))
    assert len(view.alerts) == 2
    assert view.alerts[0].startswith(
        "The ledger of unreachable cannot be read: the database of connection 'view_broken' cannot be reached:"
        " cannot connect to PostgreSQL ("
    )
    assert "127.0.0.1" in view.alerts[0] and "password" not in view.alerts[0]
    assert len(view.rows) == 4  # the reachable policy's runs

    # A reader who may not read the connections sees that it failed, and which connection, nothing more.
    hidden = [p.without_connection_details() for p in panels]
    page = overview_page(PolicySet(SOURCE, [p.policy for p in panels]), hidden, AS_OF)
    alerts = ViewReader(page).alerts
    assert alerts[0] == (
        "The ledger of unreachable cannot be read: the database of connection 'view_broken' cannot be reached"
    )
    assert "127.0.0.1" not in page and "dbname" not in page and "port" not in page


def test_a_ledger_that_cannot_be_read_is_a_message(seeded: Seeded, schema: str, admin: Any) -> None:
    other = RetentionPolicy.from_dict(
        {**view_policy_data(schema, "view_ok", FIRST_ANCHOR, name="elsewhere"), "ledger_schema": f"{schema}_gone"}
    )
    with admin.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{schema}_gone"')
        cur.execute(f'CREATE TABLE "{schema}_gone".ledger_version (version integer)')  # a broken ledger
        cur.execute(f'INSERT INTO "{schema}_gone".ledger_version VALUES (4)')
    try:
        panels = load_panels([other, seeded.policy], as_of=AS_OF)
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP SCHEMA "{schema}_gone" CASCADE')
    assert panels[0].status is None
    assert panels[0].error == f"ledger schema '{schema}_gone' of connection 'view_ok'"
    assert panels[0].detail  # the driver's words, for readers of the connection only
    assert panels[1].status is not None and len(panels[1].status.runs) == 4


def test_the_run_page_shows_each_chunk_as_the_ledger_has_it(seeded: Seeded, admin: Any) -> None:
    policy = seeded.policy
    detail = load_run(policy, seeded.partial)
    assert detail is not None
    view = ViewReader(run_page(detail))
    expected = ledger_chunks(admin, policy.ledger_schema, seeded.partial)
    assert set(view.rows) == set(expected) and len(expected) >= 3
    for key, want in expected.items():
        shown = view.rows[key]
        assert shown["state"] == want["state"]
        assert int(shown["rows_deleted"]) == want["rows_deleted"]
        assert int(shown["attempts"]) == want["attempts"]
        assert shown["last_error"] == (want["last_error"] or "")
    assert view.rows[seeded.failing_chunk]["last_error"] == CHUNK_ERROR
    done = sum(1 for c in expected.values() if c["state"] == "complete")
    assert view.texts["chunks done"] == [f"{done}/{len(expected)}"]
    assert view.texts["rows deleted"] == [f"{sum(c['rows_deleted'] for c in expected.values()):,}"]
    ranges = [view.rows[k]["range"] for k in expected]
    assert all(r.startswith("ids ") for r in ranges)  # the chunk's range as every other place writes it


def test_an_unknown_run_or_another_policys_run_is_not_found(seeded: Seeded, schema: str) -> None:
    assert load_run(seeded.policy, "events_purge@1999-01-01T00:00:00Z") is None
    stranger = RetentionPolicy.from_dict(view_policy_data(schema, "view_ok", FIRST_ANCHOR, name="stranger"))
    assert load_run(stranger, seeded.partial) is None
    with pytest.raises(Exception, match="cannot connect to PostgreSQL"):
        load_run(broken_policy(schema), seeded.partial)


def test_the_views_sessions_cannot_write(seeded: Seeded) -> None:
    with ledger_session(target_for(seeded.policy, None)) as conn:
        with conn.cursor() as cur, pytest.raises(psycopg2.errors.ReadOnlySqlTransaction):
            cur.execute(f'DELETE FROM "{seeded.policy.ledger_schema}".runs')
        conn.rollback()
        with conn.cursor() as cur:
            cur.execute("SHOW statement_timeout")
            assert cur.fetchone()[0] == "15s"


def test_a_missing_table_a_failing_latest_run_and_an_invalid_policy_are_shown_failing(
    seeded: Seeded, schema: str, admin: Any
) -> None:
    """What the operator of the wrong-database report saw as "No runs in the ledger yet": the view now
    says in red that the next plan fails and why (naming the database only to connection readers); a
    latest run stopped on a chunk error is failing; an invalid entry of the file is shown under its DAG."""
    from airflow_retention.core.errors import PolicyError
    from airflow_retention.plugins.data import PolicyProblem

    ghost = RetentionPolicy.from_dict(
        {
            **view_policy_data(schema, "view_ok", FIRST_ANCHOR, name="ghost"),
            "table": f"{schema}.ghost",
            "ledger_schema": f"{schema}_ghost",
        }
    )
    # The seeded run stopped on a chunk error becomes the one planned last (a backfill of its day, say),
    # with no batch for half an hour.
    stopped(admin, seeded.policy.ledger_schema, seeded.partial)
    panels = load_panels([ghost, seeded.policy], as_of=AS_OF)
    database = panels[1].status and admin.info.dbname
    problem = PolicyProblem("retention_typo", str(PolicyError("typo", "conditon", "unknown key")))
    page = overview_page(PolicySet(SOURCE, [ghost, seeded.policy], [problem]), panels, AS_OF)
    view = ViewReader(page)
    assert view.texts["failing"] == [
        f"the next plan fails: policy 'ghost': table {schema}.ghost does not exist in database {database!r} of"
        " connection 'view_ok' (or this role cannot see it)",
        f"run {seeded.partial}: chunk {seeded.failing_chunk} (pending): {CHUNK_ERROR}",
    ]
    assert (
        "Invalid policy (DAG retention_typo fails at once until it is fixed): policy 'typo', field 'conditon':"
        " unknown key"
    ) in view.alerts

    hidden = overview_page(
        PolicySet(SOURCE, [ghost, seeded.policy]), [p.without_connection_details() for p in panels], AS_OF
    )
    assert ViewReader(hidden).texts["failing"][0] == (
        f"the next plan fails: policy 'ghost': table {schema}.ghost does not exist in the database of connection"
        " 'view_ok' (or this role cannot see it)"
    )
    assert repr(database) not in hidden
    # Looking created nothing: no ledger schema in the database without the table's policy.
    with admin.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (f"{schema}_ghost",))
        assert cur.fetchone()[0] == 0


def test_a_reader_of_the_dag_but_not_of_the_connection_sees_no_database_or_role_in_any_message(
    seeded: Seeded, schema: str, admin: Any
) -> None:
    """A failed plan's error is the driver's: it may name the database or the role. For a reader of the DAG
    who may not read the connection, every value of the connection is blanked from every message."""
    from airflow_retention.core.ledger.ledger import Ledger

    database, role = admin.info.dbname, admin.info.user
    conn = psycopg2.connect(DSN)
    try:
        error = f'permission denied for database {database}: role "{role}" may not create schemas'
        assert Ledger(seeded.policy.ledger_schema).record_plan_failure(
            conn, "events_purge", "events_purge@2030-01-01T00:00:00Z", FIRST_ANCHOR, error, "test"
        )
    finally:
        conn.close()
    (panel,) = load_panels([seeded.policy], as_of=AS_OF)
    assert panel.status is not None
    (failure,) = [w for w in panel.status.failures if w.kind == "plan_failed"]
    assert database in failure.message and role in failure.message
    page = overview_page(PolicySet(SOURCE, [seeded.policy]), [panel.without_connection_details()], AS_OF)
    (shown,) = [t for t in ViewReader(page).texts["failing"] if "its plan failed" in t]
    assert 'permission denied for database …: role "…" may not create schemas' in shown
    assert database not in shown and role not in shown


def _chart_values(html: str, css: str, attribute: str) -> dict[str, float]:
    """Per run key, ``attribute`` of the chart's elements of class ``css``."""
    found = re.findall(rf'class="{css}"[^>]*data-run-key="([^"]+)"[^>]*{attribute}="([^"]+)"', html)
    return {key: float(value) for key, value in found}


def _observations(admin: Any, ledger_schema: str, run_key: str) -> tuple[int, int]:
    """The budget's observations over a complete run's span (planned to verified): all, and at the floor
    or paused; counted with the test's own SQL."""
    with admin.cursor() as cur:
        cur.execute(
            "SELECT count(*), count(*) FILTER (WHERE o.paused OR (o.concurrency = 1 AND o.duty <= %s))"
            f' FROM "{ledger_schema}".runs r'
            f' JOIN "{ledger_schema}".budget_observations o ON o.at BETWEEN r.planned_at AND r.completed_at'
            " WHERE r.run_key = %s",
            (FLOOR_DUTY, run_key),
        )
        n, floor = cur.fetchone()
        return int(n), int(floor)


def test_the_budget_its_pauses_and_the_pressure_of_each_run_are_the_ledgers(seeded: Seeded, admin: Any) -> None:
    """The engine's runs left observations and pauses (their own duty cycle); rows written here add what
    it cannot produce in seconds: the budget paused for a standby's lag, and a run held at its floor."""
    policy = seeded.policy
    floor_run = seeded.complete[-1]
    seed_budget_pressure(admin, policy.ledger_schema, seeded.partial, floor_run)
    (panel,) = load_panels([policy], as_of=AS_OF)
    assert panel.budget_error is None and panel.budget is not None
    assert panel.budget.paused and panel.budget.live and panel.budget.reasons == (PAUSE_REASON,)
    assert panel.budget.describe() == "paused"

    # Seconds paused per reason: the chunks' own, summed. The engine rested after each batch at half duty
    # (``max_duty_cycle``), or at a lower duty the budget set, under the budget's reason: its slow start, or a
    # signal such as ``canary_latency`` while the other tests' sessions worked (CI's runs rested only so).
    pauses = ledger_pauses(admin, policy.ledger_schema)
    assert all(sum(pauses.get(k, {}).values()) > 0 for k in seeded.complete), pauses
    for key, run in panel.run_budgets.items():
        assert run.paused_s == pytest.approx(pauses.get(key, {})), key
    # The pressure of each complete run: every observation of its span, counted by the test's SQL.
    for key in seeded.complete:
        n, floor = _observations(admin, policy.ledger_schema, key)
        pressure = panel.run_budgets[key].pressure
        assert pressure is not None and pressure.observations == n > 0, key
        assert pressure.floor_share == pytest.approx(floor / n), key
    assert panel.run_budgets[floor_run].pressure.floor_share > 0.5
    # The latest run with a chunk error stopped, but the budget is paused now: throttled, not stuck.
    assert [k for k, r in panel.run_budgets.items() if r.hold] == [seeded.partial]
    assert panel.run_budgets[seeded.partial].hold == THROTTLED

    html = overview_page(PolicySet(SOURCE, [policy]), [panel], AS_OF)
    view = ViewReader(html)
    (budget,) = view.texts["budget"]
    assert budget.startswith("paused ·") and "purges steer by it now" in budget
    assert view.texts["budget_reason"] == [PAUSE_REASON]
    for key in view.rows:
        shown = view.rows[key]
        total = sum(pauses.get(key, {}).values())
        assert float(shown["paused"]) == pytest.approx(total), key
        assert shown["hold"] == (THROTTLED if key == seeded.partial else ""), key
    # The chart puts each run's pressure under its cleanup lag: the share allowed and the canary's p90.
    allowed = _chart_values(html, "allowed", "data-allowed")
    assert set(allowed) == set(view.rows)
    for key, value in allowed.items():
        assert value == pytest.approx(panel.run_budgets[key].pressure.allowed_mean, rel=1e-4), key
    assert set(_chart_values(html, "canary-point", "data-canary-ratio")) == set(view.rows)
    assert set(_chart_values(html, "lag-point", "data-lag")) == set(view.lag_points)
    # The SLO: the budget held the last complete run at its floor most of the time; its warning is shown
    # once, under the SLO, with the status's words.
    assert panel.slo is not None and panel.slo.floor_share > 0.5
    (warning,) = view.texts["slo_warning"]
    assert warning.startswith("exhausted database budget: held at its floor for")
    assert html.count("exhausted database budget") == 1


def test_a_run_without_batches_is_stuck_unless_the_budget_paused_it(seeded: Seeded, admin: Any) -> None:
    """No batch for two hours and no pause recorded since: stuck. A pause the budget recorded since its last
    batch (the budget's observations) or the budget paused now: throttled on purpose."""
    policy, ledger = seeded.policy, f'"{seeded.policy.ledger_schema}"'
    with admin.cursor() as cur:
        cur.execute(
            f"UPDATE {ledger}.runs SET planned_at = now() - interval '3 hours' WHERE run_key = %s", (seeded.partial,)
        )
        cur.execute(
            f"UPDATE {ledger}.chunks SET last_batch_at = now() - interval '2 hours'"
            " WHERE run_key = %s AND last_batch_at IS NOT NULL",
            (seeded.partial,),
        )

    def hold() -> tuple[str, str, str]:
        (panel,) = load_panels([policy], as_of=AS_OF)
        run = panel.run_budgets[seeded.partial]
        shown = ViewReader(overview_page(PolicySet(SOURCE, [policy]), [panel], AS_OF)).rows[seeded.partial]
        assert shown["hold"] == (run.hold or "")
        return run.hold or "", run.hold_text, shown["state"]

    state, text, shown_state = hold()
    assert state == STUCK and shown_state == "planned"
    assert text.startswith("stuck: no batch for 2 h") and "no pause recorded since" in text
    # The budget paused the purges after its last batch (and is not paused any more): held on purpose.
    with admin.cursor() as cur:
        cur.execute(
            f"INSERT INTO {ledger}.budget_observations (at, scope, level, concurrency, duty, paused, move,"
            " signals, reasons) VALUES (now() - interval '1 hour', 'database', 5, 1, 1.0, true, 'pause', '{}',"
            " %s)",
            ([PAUSE_REASON],),
        )
    state, text, _ = hold()
    assert state == THROTTLED
    assert text == f"throttled on purpose: the database budget paused the purges: {PAUSE_REASON}; no batch for 2 h"
    # Without that observation but with the budget paused now: throttled too.
    with admin.cursor() as cur:
        cur.execute(f"DELETE FROM {ledger}.budget_observations WHERE paused")
        cur.execute(
            f"UPDATE {ledger}.budget_state SET paused = true, reasons = %s, observed_at = clock_timestamp()",
            (["lock_waiters 3 > 0"],),
        )
    state, text, _ = hold()
    assert state == THROTTLED and "is paused: lock_waiters 3 > 0" in text
    # The same state left by a purge long gone steers nothing: stuck again.
    with admin.cursor() as cur:
        cur.execute(f"UPDATE {ledger}.budget_state SET observed_at = now() - interval '90 minutes'")
    assert hold()[0] == STUCK


def test_the_run_page_charts_the_budgets_observations_beside_the_cleanup_lag(seeded: Seeded, admin: Any) -> None:
    policy = seeded.policy
    seed_budget_pressure(admin, policy.ledger_schema, seeded.partial)
    detail = load_run(policy, seeded.partial)
    assert detail is not None and detail.budget is not None and detail.state is not None
    assert detail.budget.hold == THROTTLED
    with admin.cursor() as cur:
        cur.execute(
            f'SELECT count(*) FILTER (WHERE paused), count(*) FROM "{policy.ledger_schema}".budget_observations'
            f' WHERE at >= (SELECT planned_at FROM "{policy.ledger_schema}".runs WHERE run_key = %s)',
            (seeded.partial,),
        )
        paused, total = cur.fetchone()
    assert paused == 5 and 1 <= len(detail.points) <= total
    # The five paused observations are spread from its last batch to now: each its own point of the chart.
    assert sum(p.paused for p in detail.points) == 5
    html = run_page(detail)
    assert 'data-paused-points="5"' in html and html.count('class="paused"') == 5
    assert f"cleanup lag {lag_text(detail.summary)}</text>" in html
    view = ViewReader(html)
    assert view.texts["paused"] == [detail.budget.paused_text()]
    assert view.texts["held"][0].startswith("throttled on purpose")
    # Each chunk's pauses as its ledger row has them.
    with admin.cursor() as cur:
        cur.execute(
            f'SELECT chunk_key, paused FROM "{policy.ledger_schema}".chunks WHERE run_key = %s', (seeded.partial,)
        )
        raw = dict(cur.fetchall())
    for key, paused_by in raw.items():
        assert float(view.rows[key]["paused"]) == pytest.approx(sum(paused_by.values())), key
    assert any(raw.values())
    # A long run's observations are averaged into a bounded number of points.
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.plugins.budget import run_points

    with ledger_session(target_for(policy, None)) as conn:
        few = run_points(conn, Ledger(policy.ledger_schema), detail.summary.planned_at, datetime.now(timezone.utc), 3)
    assert 1 <= len(few) <= 3 and any(p.paused for p in few)


def test_a_policy_with_the_budget_off_says_so(seeded: Seeded, schema: str) -> None:
    off = RetentionPolicy.from_dict({**view_policy_data(schema, "view_ok", FIRST_ANCHOR), "budget": False})
    (panel,) = load_panels([off], as_of=AS_OF)
    view = ViewReader(overview_page(PolicySet(SOURCE, [off]), [panel], AS_OF))
    assert view.texts["budget"] == ["Off for this policy (budget: false)."]
