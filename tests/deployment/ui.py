"""Drive the Airflow 3.x web UI (Simple auth manager) in headless Chromium with Playwright.

Written against Airflow 3.3.2. The flow is the one a user clicks through: sign in, open a Dag's page, open the
Trigger dialog, switch it to "Backfill", pick the date range in the UI's own date pickers and the reprocess
behaviour, press "Run Backfill", then wait for the backfill's runs to finish (the state is polled over the
REST API with the page's own session cookie, then read back from the grid's tooltips) and screenshot the grid.

Playwright is imported only for type checking, so this module imports without it; the caller owns the
``sync_playwright()`` context. Selectors the UI could change are collected at the top of the module.

Example::

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = new_page(browser)
        base = "http://127.0.0.1:8080"
        login(page, base, "admin", password)
        backfill = create_backfill(page, base, "my_dag", "2026-11-25", "2026-11-27", reprocess="failed")
        wait_for_runs(page, base, "my_dag", backfill.expected_runs, 300, backfill=backfill)
        screenshot_grid(page, base, "my_dag", "/tmp/grid.png")
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tests.deployment.harness import budget

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page, Playwright, Response

CHROMIUM_PATH = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless=new",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

# Reprocess behaviour: the API value (also the radio input's value in the dialog) -> the label the UI shows.
REPROCESS_LABELS = {
    "none": "Missing Runs",
    "failed": "Missing and Errored Runs",
    "completed": "All Runs",
}

# --- Selectors and labels relied on (Airflow 3.3.2 UI). Fix here when the UI changes. ---
SEL_LOGIN_USER = 'input[name="username"]'  # Simple auth manager login form (/auth/login)
SEL_LOGIN_PASSWORD = 'input[name="password"]'
SEL_LOGIN_SUBMIT = 'button[type="submit"]'  # "Sign in"
SEL_TRIGGER_BUTTON = '[data-testid="trigger-dag-button"]'  # "Trigger" at the top right of a Dag's page
SEL_RADIO_ITEM = 'label[data-scope="radio-group"][data-part="item"]'  # radio cards; the input carries the value
SEL_CHECKBOX = 'label[data-scope="checkbox"][data-part="root"]'  # data-state="checked" | "unchecked"
SEL_DATETIME = '[data-testid="datetime-input"]'  # "From" (0) and "To" (1) popover triggers
SEL_OPEN_POPOVER = '[data-scope="popover"][data-part="content"][data-state="open"]'
DATE_PLACEHOLDER = "YYYY/MM/DD"  # the popover's typed date field ("HH:mm" is the time field)
SEL_MAX_ACTIVE_RUNS = 'input[name="max_active_runs"]'
RUN_BACKFILL_LABEL = "Run Backfill"
RUN_BACKWARDS_LABEL = "Run Backwards"
UNPAUSE_LABEL = re.compile(r"^\s*Unpause .+ on trigger\s*$")  # shown only while the Dag is paused
DRY_RUN_TEXT = re.compile(r"(\d+) runs? will be triggered|No runs matching selected criteria")
SEL_GRID_VIEW_BUTTON = '[data-testid="grid-view-button"]'
COLLAPSE_DETAILS_LABEL = "Collapse Details Panel"
# localStorage keys of the UI (values are JSON); "timezone" defaults to the *browser's* time zone.
LS_TIMEZONE = "timezone"
LS_DAG_RUNS_LIMIT = "dag_runs_limit-{dag_id}"

TERMINAL_STATES = frozenset({"success", "failed"})
# Playwright's wait for one action or page load (its default is 30 s): a page of the UI loads in a few seconds
# on the loaded 2-core machine, see harness.budget.
ACTION_TIMEOUT_S = budget(15)


@dataclass
class BackfillInfo:
    """What the UI's ``POST /api/v2/backfills`` returned, plus the dialog's dry run.

    ``logical_dates`` are the runs the dialog announced ("N runs will be triggered"), as ISO strings.
    """

    id: int
    dag_id: str
    from_date: str
    to_date: str
    reprocess_behavior: str
    created_at: str
    expected_runs: int
    logical_dates: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def launch_browser(playwright: Playwright, executable_path: str = CHROMIUM_PATH) -> Browser:
    """Launch the system's headless Chromium (Debian's ``chromium`` package), not a Playwright download."""
    return playwright.chromium.launch(executable_path=executable_path, args=list(CHROMIUM_ARGS))


def new_page(browser: Browser, width: int = 1600, height: int = 1000, timezone_id: str = "UTC") -> Page:
    """Open a page in a fresh context with a fixed viewport and browser time zone (UTC by default)."""
    context = browser.new_context(viewport={"width": width, "height": height}, timezone_id=timezone_id)
    context.set_default_timeout(ACTION_TIMEOUT_S * 1000)
    context.set_default_navigation_timeout(ACTION_TIMEOUT_S * 1000)
    return context.new_page()


def _base(base_url: str) -> str:
    return base_url.rstrip("/")


def _to_utc_datetime(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def login(page: Page, base_url: str, username: str, password: str, timeout_s: float = ACTION_TIMEOUT_S) -> None:
    """Sign in through the Simple auth manager's login form; on return the ``_token`` cookie is set.

    The form posts to ``/auth/token``; RuntimeError when that is refused (wrong password: 401) or when the
    page does not leave ``/auth/login`` within ``timeout_s``.
    """
    base = _base(base_url)
    page.goto(f"{base}/auth/login?next=/", timeout=timeout_s * 1000)
    page.locator(SEL_LOGIN_USER).fill(username)
    page.locator(SEL_LOGIN_PASSWORD).fill(password)

    def is_token(r: Response) -> bool:
        return r.request.method == "POST" and urlparse(r.url).path.endswith("/auth/token")

    with page.expect_response(is_token, timeout=timeout_s * 1000) as token_info:
        page.locator(SEL_LOGIN_SUBMIT).click()
    resp = token_info.value
    if not resp.ok:
        raise RuntimeError(f"login as {username!r} refused: HTTP {resp.status} {resp.text()[:200]}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "/auth/login" not in urlparse(page.url).path and _session_token(page):
            return
        page.wait_for_timeout(200)
    raise RuntimeError(f"login as {username!r}: still at {page.url} after {timeout_s:.0f}s")


def _session_token(page: Page) -> str | None:
    for cookie in page.context.cookies():
        if cookie["name"] == "_token":
            return cookie["value"]
    return None


def api_get(page: Page, base_url: str, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET a REST API path (``/api/v2/...``) as the page's signed-in user and return the JSON body.

    The session cookie is sent by the page's request context; its JWT is also sent as a Bearer token.
    """
    token = _session_token(page)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = page.request.get(f"{_base(base_url)}{path}", params=params, headers=headers)
    if not resp.ok:
        raise RuntimeError(f"GET {path} -> HTTP {resp.status}: {resp.text()[:500]}")
    return resp.json()


def _list_runs(page: Page, base_url: str, dag_id: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """All runs of a Dag matching ``params`` (``GET /api/v2/dags/{dag_id}/dagRuns``, every page)."""
    runs: list[dict[str, Any]] = []
    while True:
        page_params = {**params, "limit": 100, "offset": len(runs)}
        data = api_get(page, base_url, f"/api/v2/dags/{dag_id}/dagRuns", page_params)
        runs.extend(data["dag_runs"])
        if not data["dag_runs"] or len(runs) >= data["total_entries"]:
            return runs


def _set_local_storage(page: Page, key: str, value: Any) -> None:
    """Set a UI preference (the UI stores JSON in localStorage); it takes effect on the next page load."""
    page.evaluate("([k, v]) => window.localStorage.setItem(k, v)", [key, json.dumps(value)])


def _open_dag(page: Page, base_url: str, dag_id: str) -> None:
    page.goto(f"{_base(base_url)}/dags/{dag_id}")
    page.locator(SEL_TRIGGER_BUTTON).wait_for(state="visible")


def _click_radio(dialog: Locator, value: str) -> Locator:
    item = dialog.locator(SEL_RADIO_ITEM).filter(has=dialog.page.locator(f'input[value="{value}"]'))
    item.click()
    return item


def _set_checkbox(dialog: Locator, label: str | re.Pattern[str], checked: bool) -> bool:
    """Set a Chakra checkbox found by its label text; returns False when no such checkbox is shown."""
    box = dialog.locator(SEL_CHECKBOX).filter(has_text=label)
    if box.count() == 0:
        return False
    if (box.first.get_attribute("data-state") == "checked") != checked:
        box.first.click()
    return True


def _pick_date(page: Page, dialog: Locator, index: int, day: date) -> None:
    """Type a day into the From (0) / To (1) date picker; the UI fills the time (00:00 / 23:59) itself."""
    dialog.locator(SEL_DATETIME).nth(index).click()
    popover = page.locator(SEL_OPEN_POPOVER).filter(has=page.get_by_placeholder(DATE_PLACEHOLDER))
    popover.get_by_placeholder(DATE_PLACEHOLDER).fill(day.strftime("%Y/%m/%d"))
    page.keyboard.press("Escape")  # closes only the popover, the dialog stays open
    popover.wait_for(state="hidden")


def create_backfill(
    page: Page,
    base_url: str,
    dag_id: str,
    start: str,
    end: str,
    reprocess: str = "none",
    *,
    max_active_runs: int | None = None,
    run_backwards: bool = False,
    ui_timezone: str | None = "UTC",
) -> BackfillInfo:
    """Create a backfill of ``dag_id`` for the days ``start``..``end`` (inclusive, 'YYYY-MM-DD', UTC).

    Opens the Dag's page, presses "Trigger", picks "Backfill", selects the reprocess behaviour
    (``none`` | ``failed`` | ``completed`` = "Missing Runs" | "Missing and Errored Runs" | "All Runs"),
    ticks "Unpause <dag> on trigger" when the Dag is paused, types both dates into the date pickers,
    waits for the dialog's dry run ("N runs will be triggered") and presses "Run Backfill".

    ``ui_timezone`` is stored as the UI's display time zone first (the date pickers are in that zone and the
    UI defaults to the browser's zone); pass None to keep the user's choice. Returns what the UI's own
    ``POST /api/v2/backfills`` answered. Raises ValueError when the dry run finds no run to create and
    RuntimeError when the API refuses the backfill (e.g. another backfill of the Dag is still running).
    """
    if reprocess not in REPROCESS_LABELS:
        raise ValueError(f"reprocess must be one of {sorted(REPROCESS_LABELS)}, not {reprocess!r}")
    first, last = date.fromisoformat(start), date.fromisoformat(end)
    if last < first:
        raise ValueError(f"end {end} is before start {start}")
    base = _base(base_url)
    if ui_timezone:
        if urlparse(page.url).netloc != urlparse(base).netloc:
            page.goto(f"{base}/")
        _set_local_storage(page, LS_TIMEZONE, ui_timezone)
    _open_dag(page, base, dag_id)

    page.locator(SEL_TRIGGER_BUTTON).click()
    dialog = page.get_by_role("dialog").filter(has=page.locator('input[value="backfill"]'))
    _click_radio(dialog, "backfill")
    dialog.locator(SEL_DATETIME).nth(1).wait_for(state="visible")

    item = _click_radio(dialog, reprocess)
    label = REPROCESS_LABELS[reprocess]
    if label not in item.inner_text():
        raise RuntimeError(f"reprocess radio {reprocess!r} is labelled {item.inner_text()!r}, expected {label!r}")
    if max_active_runs is not None:
        dialog.locator(SEL_MAX_ACTIVE_RUNS).fill(str(max_active_runs))
    _set_checkbox(dialog, RUN_BACKWARDS_LABEL, run_backwards)
    _set_checkbox(dialog, UNPAUSE_LABEL, True)  # a paused Dag would never run the backfill

    def is_dry_run(r: Response) -> bool:
        return r.request.method == "POST" and urlparse(r.url).path.endswith("/backfills/dry_run")

    _pick_date(page, dialog, 0, first)
    with page.expect_response(is_dry_run) as dry_info:
        _pick_date(page, dialog, 1, last)  # the dry run fires once both ends are set
    dry_resp = dry_info.value
    dry_req = dry_resp.request.post_data_json or {}
    _check_range(dry_req, first, last)
    dry = dry_resp.json()
    expected = int(dry.get("total_entries", 0))
    logical_dates = [b["logical_date"] for b in dry.get("backfills", []) if b.get("logical_date")]
    dialog.get_by_text(DRY_RUN_TEXT).wait_for(state="visible")
    if expected == 0:
        dialog.get_by_role("button", name="Cancel").click()
        raise ValueError(f"the backfill dialog found no {label!r} of {dag_id} between {start} and {end}")

    def is_create(r: Response) -> bool:
        return r.request.method == "POST" and urlparse(r.url).path.endswith("/api/v2/backfills")

    submit = dialog.get_by_role("button", name=RUN_BACKFILL_LABEL)
    with page.expect_response(is_create) as create_info:
        submit.click()
    resp = create_info.value
    if not resp.ok:
        raise RuntimeError(f"the UI's POST /api/v2/backfills failed: HTTP {resp.status} {resp.text()[:500]}")
    body = resp.json()
    _check_range(body, first, last)
    dialog.wait_for(state="hidden")
    return BackfillInfo(
        id=int(body["id"]),
        dag_id=body["dag_id"],
        from_date=body["from_date"],
        to_date=body["to_date"],
        reprocess_behavior=body["reprocess_behavior"],
        created_at=body["created_at"],
        expected_runs=expected,
        logical_dates=logical_dates,
        raw=body,
    )


def _check_range(payload: dict[str, Any], first: date, last: date) -> None:
    """The UI converts the picked wall-clock times from its display zone to UTC: make sure they are the days."""
    got = (payload.get("from_date", ""), payload.get("to_date", ""))
    if not (got[0].startswith(f"{first.isoformat()}T00:00:00") and got[1].startswith(f"{last.isoformat()}T23:59")):
        raise RuntimeError(
            f"the dialog sent from_date={got[0]!r} to_date={got[1]!r} for {first}..{last}; is the UI's time zone "
            "(the clock button in the left nav, localStorage 'timezone') something other than UTC?"
        )


def _backfill_runs(
    page: Page, base_url: str, dag_id: str, backfill: BackfillInfo | None
) -> tuple[list[dict[str, Any]], bool]:
    """The runs a backfill made or re-ran (or every backfill-type run), and whether the backfill is done."""
    if backfill is None:
        return _list_runs(page, base_url, dag_id, {"run_type": "backfill"}), True
    candidates = _list_runs(
        page, base_url, dag_id, {"logical_date_gte": backfill.from_date, "logical_date_lte": backfill.to_date}
    )
    created = _to_utc_datetime(backfill.created_at) - timedelta(seconds=1)  # slack for clock rounding
    wanted = {_to_utc_datetime(d) for d in backfill.logical_dates}
    runs = [
        r
        for r in candidates
        if r.get("queued_at")
        and _to_utc_datetime(r["queued_at"]) >= created  # re-run runs keep their run_id but are queued anew
        and (not wanted or _to_utc_datetime(r["logical_date"]) in wanted)
    ]
    runs.sort(key=lambda r: r["logical_date"] or "")
    info = api_get(page, base_url, f"/api/v2/backfills/{backfill.id}")
    return runs, info.get("completed_at") is not None


def wait_for_runs(
    page: Page,
    base_url: str,
    dag_id: str,
    count: int,
    timeout_s: float = 300.0,
    *,
    backfill: BackfillInfo | None = None,
    poll_s: float = 2.0,
    require_success: bool = True,
    check_grid: bool = True,
    wait_backfill_done: bool = True,
) -> list[dict[str, Any]]:
    """Wait until ``count`` backfill runs of ``dag_id`` are finished, and the grid shows them so.

    With ``backfill`` (what :func:`create_backfill` returned) only the runs that backfill queued count, and
    unless ``wait_backfill_done`` is False the backfill itself must be marked completed too: the scheduler does
    that up to ~30 s after its last run ends, and until then the UI shows "Backfill in progress" and refuses
    another backfill of the Dag. Without ``backfill``, any ``run_type=backfill`` run counts.

    States are polled over the REST API as the page's user; then the Dag's page is reloaded and each run's
    bar in the grid is hovered and its tooltip's "State:" must match (``check_grid``).
    Returns the runs (REST JSON). Raises TimeoutError, or AssertionError when ``require_success`` and a run
    failed or the grid disagrees.
    """
    deadline = time.monotonic() + timeout_s
    runs: list[dict[str, Any]] = []
    done = False
    while True:
        runs, backfill_done = _backfill_runs(page, base_url, dag_id, backfill)
        finished = [r for r in runs if r["state"] in TERMINAL_STATES]
        done = len(runs) >= count and len(finished) == len(runs) and (backfill_done or not wait_backfill_done)
        if done or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if not done:
        states = {r["dag_run_id"]: r["state"] for r in runs}
        raise TimeoutError(f"after {timeout_s:.0f}s {len(runs)}/{count} runs of {dag_id}, states: {states}")
    if require_success:
        failed = [r["dag_run_id"] for r in runs if r["state"] != "success"]
        if failed:
            raise AssertionError(f"runs of {dag_id} did not succeed: {failed}")
    if check_grid:
        _check_grid(page, base_url, dag_id, runs)
    return runs


def _show_runs_in_grid(page: Page, base_url: str, dag_id: str, runs: list[dict[str, Any]]) -> None:
    """Make the grid's "Number of Dag Runs" large enough to include the oldest of ``runs``, then load it.

    The setting is the UI's own (the grid's options menu) and stays in the browser context's localStorage.
    """
    limit = 10  # the UI's default
    if runs:
        oldest = min(r["run_after"] for r in runs)
        newer = api_get(page, base_url, f"/api/v2/dags/{dag_id}/dagRuns", {"run_after_gte": oldest, "limit": 1})[
            "total_entries"
        ]
        limit = next((n for n in (10, 25, 50) if n >= newer), max(50, newer))
    _set_local_storage(page, LS_DAG_RUNS_LIMIT.format(dag_id=dag_id), limit)
    _open_dag(page, base_url, dag_id)
    grid_button = page.locator(SEL_GRID_VIEW_BUTTON)
    if grid_button.count():
        grid_button.click()


def _check_grid(page: Page, base_url: str, dag_id: str, runs: list[dict[str, Any]]) -> None:
    _show_runs_in_grid(page, base_url, dag_id, runs)
    for run in runs:
        run_id = run["dag_run_id"]
        bar = page.locator(f'a[href$="/dags/{dag_id}/runs/{run_id}/"]').first
        bar.wait_for(state="visible")
        bar.hover()
        tooltip = page.get_by_text(f"Run ID: {run_id}").last
        tooltip.wait_for(state="visible")
        match = re.search(r"State:\s*(\w+)", tooltip.inner_text())
        page.mouse.move(0, 0)
        shown = match.group(1).lower() if match else None
        if shown != run["state"]:
            raise AssertionError(f"the grid shows {run_id} as {shown!r}, the API says {run['state']!r}")


def screenshot_grid(
    page: Page,
    base_url: str,
    dag_id: str,
    path: str,
    *,
    collapse_details: bool = False,
    full_page: bool = False,
    settle_s: float = 1.0,
) -> None:
    """Screenshot the Dag's page in grid view (header, backfill banner and the grid of runs) to ``path``.

    ``collapse_details`` hides the right-hand details panel so the grid takes the page's whole width.
    """
    _open_dag(page, base_url, dag_id)
    grid_button = page.locator(SEL_GRID_VIEW_BUTTON)
    if grid_button.count():
        grid_button.click()
    page.locator("[data-run-id]").first.wait_for(state="visible")
    if collapse_details:
        page.get_by_role("button", name=COLLAPSE_DETAILS_LABEL).click()
    page.mouse.move(0, 0)  # no hover tooltip in the picture
    # The bars animate in: wait for the page's finite animations to end (a spinner's never does), then a
    # moment for any it drives from script.
    page.wait_for_function(
        "() => document.getAnimations().every("
        "a => a.playState !== 'running' || a.effect?.getComputedTiming().iterations === Infinity)"
    )
    page.wait_for_timeout(settle_s * 1000)
    page.screenshot(path=path, full_page=full_page)


def _main() -> None:
    """Log in, backfill, wait and screenshot from the command line (see ``--help``)."""
    import argparse

    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080")
    parser.add_argument("--username", default="admin")
    parser.add_argument("--password", required=True)
    parser.add_argument("--dag-id", required=True)
    parser.add_argument("--start", required=True, help="YYYY-MM-DD")
    parser.add_argument("--end", required=True, help="YYYY-MM-DD (inclusive)")
    parser.add_argument("--reprocess", default="none", choices=sorted(REPROCESS_LABELS))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--screenshot", default="/tmp/ui_grid.png")
    args = parser.parse_args()
    with sync_playwright() as p:
        browser = launch_browser(p)
        try:
            page = new_page(browser)
            t0 = time.monotonic()
            login(page, args.base_url, args.username, args.password)
            backfill = create_backfill(page, args.base_url, args.dag_id, args.start, args.end, args.reprocess)
            print(f"backfill {backfill.id}: {backfill.expected_runs} runs {backfill.logical_dates}")
            runs = wait_for_runs(
                page, args.base_url, args.dag_id, backfill.expected_runs, args.timeout, backfill=backfill
            )
            print(f"{len(runs)} runs finished in {time.monotonic() - t0:.1f}s:")
            for run in runs:
                print(f"  {run['dag_run_id']} {run['state']} {run['run_type']}")
            screenshot_grid(page, args.base_url, args.dag_id, args.screenshot)
            print(f"grid screenshot: {args.screenshot}")
        finally:
            browser.close()


if __name__ == "__main__":
    _main()
