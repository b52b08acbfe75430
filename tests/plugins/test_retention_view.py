"""The Retention view in a real Airflow 3 api-server, through Debian's Chromium: it is refused without a
login; logged in, Browse → Retention opens it inside the UI; the numbers it shows are the ledger's; a policy
whose connection fails shows a message while the other still shows; a failed run, a failed plan and a
table missing from its database are shown failing, in red; a run opens on its chunks; a viewer who may read
only some DAGs sees only those, failures included, and no connection's details. Screenshots go to test-artifacts/."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import requests

from tests.conftest import REPO
from tests.deployment.harness import Deployment, budget

from .conftest import BROKEN_CONN, LIMITED_DAGS, PLAN_ERROR
from .helpers import (
    CHUNK_ERROR,
    PAUSE_REASON,
    Seeded,
    ViewReader,
    connection_details,
    ledger_chunks,
    ledger_runs,
    shown_policies,
    shown_problems,
)

if TYPE_CHECKING:
    from playwright.sync_api import FrameLocator

pytestmark = pytest.mark.scheduler

ARTIFACTS = REPO / "test-artifacts"
PROBLEMS = {"retention_bad_retention", "retention_invalid_policies"}  # the invalid policies' DAGs


def read_frame(frame: FrameLocator, rows: str, count: int, timeout_s: float = budget(10)) -> ViewReader:
    """The framed page once it shows ``count`` of ``rows``, read as a whole. The UI may reload its frame
    once after the first load (it keeps the frame's address in its own), so the page is read again until
    one reading holds every row."""
    frame.locator(rows).nth(count - 1).wait_for(state="visible", timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    while True:
        view = ViewReader(frame.locator("html").evaluate("e => e.outerHTML"))
        if len(view.rows) == count or time.monotonic() > deadline:
            return view
        time.sleep(0.2)


def failing(frame: FrameLocator, policy: str) -> list[str]:
    """The red "Failing" lines of a policy's section, as shown."""
    lines = frame.locator(f'section[data-policy="{policy}"] [data-field="failing"]')
    return [" ".join(lines.nth(i).inner_text().split()) for i in range(lines.count())]


def test_the_view_is_refused_without_a_login(view_deployment: Deployment) -> None:
    url = f"{view_deployment.base_url}/retention/"
    for cookies in ({}, {"_token": "not-a-token"}):
        response = requests.get(url, cookies=cookies, timeout=30)
        assert response.status_code == 401, (cookies, response.status_code, response.text[:300])
        assert "Log in to Airflow" in response.text and "events_purge@" not in response.text
    run = requests.get(f"{url}run", params={"policy": "events_purge", "key": "x"}, timeout=30)
    assert run.status_code == 401
    # An API client with a token is a logged-in user.
    ok = requests.get(url, headers={"Authorization": f"Bearer {view_deployment.token()}"}, timeout=30)
    assert ok.status_code == 200 and "events_purge@" in ok.text
    assert ok.headers["Cache-Control"] == "no-store"


def test_a_run_page_says_what_it_cannot_show(view_deployment: Deployment, view_seeded: Seeded) -> None:
    url = f"{view_deployment.base_url}/retention/run"
    headers = {"Authorization": f"Bearer {view_deployment.token()}"}

    def get(policy: str, key: str) -> requests.Response:
        return requests.get(url, params={"policy": policy, "key": key}, headers=headers, timeout=60)

    assert get("events_purge", view_seeded.partial).status_code == 200
    unknown_run = get("events_purge", "events_purge@1999-01-01T00:00:00Z")
    assert unknown_run.status_code == 404 and "The ledger has no run" in unknown_run.text
    assert get("no_such_policy", view_seeded.partial).status_code == 404
    unreachable = get("unreachable", view_seeded.partial)
    assert unreachable.status_code == 503 and "cannot connect to PostgreSQL" in unreachable.text


def test_the_view_in_the_ui_shows_the_ledger(view_deployment: Deployment, view_seeded: Seeded, view_admin: Any) -> None:
    from playwright.sync_api import sync_playwright

    from tests.deployment.ui import launch_browser, login, new_page

    base = view_deployment.base_url
    ledger = view_seeded.policy.ledger_schema
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = launch_browser(p)
        try:
            page = new_page(browser, width=1400, height=1500)
            login(page, base, "admin", view_deployment.admin_password)

            # The navigation entry: Browse → Retention opens the view inside the UI.
            page.goto(f"{base}/")
            page.get_by_role("button", name="Browse").click()
            page.get_by_role("menuitem", name="Retention").click()
            page.wait_for_url(f"{base}/plugin/retention**")
            frame = page.frame_locator('iframe[title="Retention"]')
            view = read_frame(frame, "tr[data-run-key]", 4)

            # The numbers shown are the ledger's.
            expected = ledger_runs(view_admin, ledger)
            assert set(view.rows) == set(expected) == {*view_seeded.complete, view_seeded.partial}
            for key, want in expected.items():
                shown = view.rows[key]
                assert (shown["chunks"], int(shown["rows_deleted"])) == (want["chunks"], want["rows_deleted"]), key
                assert view.bars[key] == want["rows_deleted"], key
                lag = want["cleanup_lag"]
                assert (shown["cleanup_lag"] == "") if lag is None else (float(shown["cleanup_lag"]) == lag), key
            assert view.rows[view_seeded.partial]["state"] == "planned"
            assert view.lag_points[view_seeded.partial] > 0
            partial_row = frame.locator(f'tr[data-run-key="{view_seeded.partial}"]')
            deleted = expected[view_seeded.partial]["rows_deleted"]
            assert partial_row.locator('[data-field="rows_deleted"]').inner_text() == f"{deleted:,}"

            # Missed days: yesterday's (and today's, once its hour of grace is over); the partial run's day is
            # covered by the later complete runs (docs/ui.md), so it needs no backfill.
            events = frame.locator('section[data-policy="events_purge"]')
            missed = events.locator("ul.missed li")
            days = [missed.nth(i).get_attribute("data-date") for i in range(missed.count())]
            anchors = [f"{a:%Y-%m-%d}" for a in view_seeded.anchors]
            today = f"{view_seeded.anchors[4] + timedelta(days=1):%Y-%m-%d}"
            assert days in ([anchors[4]], [anchors[4], today]), days
            backfill = events.locator('pre[data-field="backfill"]').inner_text()
            assert backfill == (
                f"airflow backfill create --dag-id retention_events_purge --from-date {days[0]}T00:00:00Z"
                f" --to-date {days[-1]}T00:00:00Z"
            )

            # The broken connection is a message; the other policy above still shows.
            alert = frame.locator('section[data-policy="unreachable"] [role="alert"]')
            assert "cannot connect to PostgreSQL" in alert.inner_text()
            assert "retention_broken" in alert.inner_text()
            # Admin may read every DAG: every invalid policy is shown.
            assert shown_problems(frame.locator("html").evaluate("e => e.outerHTML")) == PROBLEMS
            # What is failing, in red, with the connection's details for a reader of the connections.
            database = view_admin.info.dbname
            assert failing(frame, "events_purge") == [
                f"run {view_seeded.partial}: chunk {view_seeded.failing_chunk} (pending): {CHUNK_ERROR}"
            ]
            assert failing(frame, "missing_table") == [
                f"the next plan fails: policy 'missing_table': table shop.gone does not exist in database"
                f" {database!r} of connection 'retention_target' (or this role cannot see it)"
            ]
            (stalled,) = failing(frame, "stalled")
            assert stalled.startswith("run stalled@") and "its plan failed at" in stalled and PLAN_ERROR in stalled

            # The database budget: its state and why, the stopped run throttled on purpose (not stuck) for
            # that reason, each run's pauses by reason, and the SLO's warning of an exhausted budget.
            budget = events.locator('[data-field="budget"]')
            assert budget.get_attribute("data-value") == "paused" and budget.inner_text().startswith("paused ·")
            assert events.locator('[data-field="budget_reason"]').all_inner_texts() == [PAUSE_REASON]
            assert view.rows[view_seeded.partial]["hold"] == "throttled"
            hold = partial_row.locator('[data-field="hold"]').inner_text()
            assert hold.startswith("throttled on purpose") and PAUSE_REASON in hold, hold
            for key in view_seeded.complete:
                paused = frame.locator(f'tr[data-run-key="{key}"] [data-field="paused"]').inner_text()
                # The engine rested at the half duty, or at the budget's slow start beside other tests.
                assert "max_duty_cycle " in paused or "slow_start " in paused, (key, paused)
            (slo_warning,) = events.locator('[data-field="slo_warning"]').all_inner_texts()
            assert slo_warning.startswith("exhausted database budget: held at its floor for"), slo_warning
            assert events.locator("svg.chart rect.allowed").count() == 4  # the pressure under each run
            page.screenshot(path=str(ARTIFACTS / "retention-view.png"), full_page=True)

            # One run's chunks, from its cutoff's link.
            partial_row.locator('[data-field="cutoff"] a').click()
            chunks = ledger_chunks(view_admin, ledger, view_seeded.partial)
            run_view = read_frame(frame, "tr[data-chunk-key]", len(chunks))
            assert set(run_view.rows) == set(chunks)
            for key, want in chunks.items():
                shown = run_view.rows[key]
                assert (shown["state"], int(shown["rows_deleted"]), int(shown["attempts"])) == (
                    want["state"],
                    want["rows_deleted"],
                    want["attempts"],
                ), key
            assert run_view.rows[view_seeded.failing_chunk]["last_error"] == CHUNK_ERROR
            assert "/plugin/retention/" in page.url  # the UI keeps the frame's page in its own address
            # The budget's observations over the run, paused ones shaded, beside its cleanup lag.
            assert frame.locator("svg.run-chart rect.paused").count() >= 1
            lag = frame.locator('svg.run-chart [data-chart="lag"]').text_content() or ""
            assert lag.startswith("cleanup lag 1 d"), lag
            page.screenshot(path=str(ARTIFACTS / "retention-view-run.png"), full_page=True)
            frame.get_by_role("link", name="← all policies").click()
            read_frame(frame, "tr[data-run-key]", 4)

            # A viewer who may read only some retention DAGs and no connection, logged in in a browser of
            # their own: their policy and invalid policy only, the failed connection named without its details.
            limited = new_page(browser, width=1400, height=900)
            login(limited, base, "limited", view_deployment.password("limited"))
            limited.goto(f"{base}/")
            limited.get_by_role("button", name="Browse").click()
            limited.get_by_role("menuitem", name="Retention").click()
            limited.wait_for_url(f"{base}/plugin/retention**")
            limited_frame = limited.frame_locator('iframe[title="Retention"]')
            limited_alert = limited_frame.locator('section[data-policy="unreachable"] [role="alert"]')
            limited_alert.wait_for(state="visible")
            assert "retention_broken" in limited_alert.inner_text()
            seen = limited_frame.locator("html").evaluate("e => e.outerHTML")
            assert shown_policies(seen) == {"unreachable", "missing_table", "stalled"}
            # Their failing policies, the database named only as the connection's.
            assert failing(limited_frame, "missing_table") == [
                "the next plan fails: policy 'missing_table': table shop.gone does not exist in the database of"
                " connection 'retention_target' (or this role cannot see it)"
            ]
            assert PLAN_ERROR in failing(limited_frame, "stalled")[0]
            assert shown_problems(seen) == PROBLEMS & set(LIMITED_DAGS)
            leaked = [
                d for d in connection_details(BROKEN_CONN) + connection_details(view_deployment.target_dsn) if d in seen
            ]
            assert not leaked and view_seeded.partial not in seen, leaked
            limited.screenshot(path=str(ARTIFACTS / "retention-view-limited.png"), full_page=True)
        finally:
            browser.close()
