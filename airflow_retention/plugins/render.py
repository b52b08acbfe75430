"""The view's HTML pages, built from :mod:`.data` values: every value from the ledger is escaped.

Links between the view's pages are relative (the view may sit under a base URL or inside the UI's frame,
whose sandbox keeps links from leaving it: the DAG is named, not linked). Cells carry ``data-field`` (and raw numbers in
``data-value``) so that a test can read exactly what a user sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape
from urllib.parse import urlencode

from airflow_retention.cli.alerts import ALWAYS_FAILING, SLO_KINDS
from airflow_retention.cli.render import lag_text, rows_text
from airflow_retention.cli.report import covered_line
from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds, short
from airflow_retention.plugins.budget import BudgetView, RunBudget
from airflow_retention.plugins.chart import ALLOWED_COLOUR, CANARY_COLOUR, run_chart, runs_chart
from airflow_retention.plugins.data import RUNS_IN_TABLE, ChunkView, PolicyPanel, PolicySet, RunDetail, dag_id

STYLE = """
:root { color-scheme: light; font-family: system-ui, sans-serif; font-size: 14px; color: #1f2328; }
body { margin: 16px 24px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 0 0 4px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
.muted { color: #656d76; } a { color: #0b62c4; }
section.policy { border: 1px solid #d0d7de; border-radius: 8px; padding: 12px 16px; margin: 16px 0; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eaeef2; vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td[data-field="range"], td[data-field="last_batch_at"], td[data-field="cutoff"] { white-space: nowrap; }
.error { background: #fff1f0; border: 1px solid #f5c2c0; color: #8a1f17; padding: 8px 12px; border-radius: 6px; }
.warning { background: #fff8e6; border: 1px solid #f0d58c; padding: 6px 10px; border-radius: 6px; margin: 4px 0; }
.state-complete { color: #1a7f37; } .state-running, .state-planned { color: #9a6700; }
code, pre { font-family: ui-monospace, monospace; font-size: 12.5px; background: #f6f8fa; padding: 2px 4px; }
pre { padding: 8px; overflow-x: auto; white-space: pre-wrap; }
svg.chart { max-width: 760px; } svg .axis { font-size: 11px; fill: #656d76; } svg .axis.lag { fill: #b5651d; }
svg .axis.canary { fill: #cf222e; } svg .axis.allowed { fill: #8250df; }
.hold-throttled { color: #9a6700; } .hold-stuck { color: #8a1f17; font-weight: 600; }
.budget-paused { color: #8a1f17; font-weight: 600; } .budget-live { color: #1a7f37; }
.legend span { margin-right: 16px; } .swatch { display: inline-block; width: 10px; height: 10px; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; } dt { color: #656d76; }
"""


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>{body}</body></html>"
    )


def run_link(policy_name: str, run_key: str) -> str:
    """The run page of a run, relative to the view's root."""
    return "run?" + urlencode({"policy": policy_name, "key": run_key})


def _num(field: str, value: int, text: str | None = None) -> str:
    return f'<td class="num" data-field="{field}" data-value="{value}">{escape(text or f"{value:,}")}</td>'


def _cell(field: str, text: str, css: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return f'<td data-field="{field}"{cls}>{escape(text)}</td>'


def _state(summary: RunSummary) -> str:
    status = summary.status if summary.kind in ("planned", "lone") else f"{summary.status} (dry run)"
    if summary.state == "complete":
        # A run whose plan left leaf partitions past the chunk budget did not cover the table: amber.
        css = "state-running" if summary.leaves_deferred else "state-complete"
    else:
        css = "state-running" if summary.running else "state-planned"
    return _cell("state", status, css)


def _paused_cell(budget: RunBudget | None) -> str:
    """Seconds paused per reason (``data-value``: the total)."""
    if budget is None:
        return '<td data-field="paused" data-value="">—</td>'
    return f'<td data-field="paused" data-value="{budget.paused_total_s:g}">{escape(budget.paused_text())}</td>'


def _hold_cell(budget: RunBudget | None) -> str:
    """Throttled on purpose, stuck, or nothing to say (``data-value``: ``throttled``, ``stuck`` or empty)."""
    if budget is None or budget.hold is None:
        return '<td data-field="hold" data-value=""></td>'
    return (
        f'<td data-field="hold" data-value="{escape(budget.hold)}" class="hold-{escape(budget.hold)}"'
        f' title="{escape(budget.hold_text)}">{escape(budget.hold_text)}</td>'
    )


def runs_table(policy_name: str, runs: Sequence[RunSummary], budgets: Mapping[str, RunBudget] | None = None) -> str:
    budgets = budgets or {}
    head = (
        "<tr><th>cutoff</th><th>state</th><th class='num'>chunks done</th><th class='num'>rows deleted</th>"
        "<th class='num'>duration</th><th class='num'>cleanup lag</th><th>paused (by reason)</th>"
        "<th>held</th></tr>"
    )
    body = []
    for run in runs:
        lag = "" if run.cleanup_lag_seconds is None else f"{run.cleanup_lag_seconds:g}"
        body.append(
            f'<tr data-run-key="{escape(run.run_key)}">'
            f'<td data-field="cutoff"><a href="{escape(run_link(policy_name, run.run_key))}">'
            f"{escape(short(run.cutoff))}</a></td>"
            f"{_state(run)}"
            f'<td class="num" data-field="chunks" data-value="{run.chunks_complete}/{run.chunks_expected}">'
            f"{run.chunks_complete}/{run.chunks_expected}</td>"
            f"{_num('rows_deleted', run.rows_deleted, rows_text(run))}"
            f'<td class="num" data-field="duration">{escape(run.duration_text())}</td>'
            f'<td class="num" data-field="cleanup_lag" data-value="{lag}">{escape(lag_text(run))}</td>'
            f"{_paused_cell(budgets.get(run.run_key))}{_hold_cell(budgets.get(run.run_key))}"
            "</tr>"
        )
    return f'<table class="runs">{head}{"".join(body)}</table>'


def missed_section(panel: PolicyPanel) -> str:
    """The scheduled days of the last 31 without a complete run: those whose run could still delete rows,
    with the backfill that runs them, and apart, those a later complete run covered (nothing to backfill)."""
    status = panel.status
    assert status is not None
    line = covered_line(status.covered)
    covered = (
        f'<p class="muted" data-field="covered" data-value="{len(status.covered)}">{escape(line)}.</p>'
        if line is not None
        else ""
    )
    if not status.missed:
        return (
            '<h3>Missed days</h3><p class="muted" data-field="missed" data-value="0">None that a backfill would'
            f" purge in the last 31 days.</p>{covered}"
        )
    # A backfill of a policy whose next plan fails would fail the same way: fix that first.
    blocked = any(f.kind in ALWAYS_FAILING for f in status.failures)
    run_them = "Once the failure above is fixed, run them with:" if blocked else "Run them with:"
    items = "".join(
        f'<li data-date="{m.anchor:%Y-%m-%d}">{m.anchor:%Y-%m-%d} (cutoff {escape(short(m.cutoff))})'
        f"{'' if m.in_ledger else ' — never planned'}</li>"
        for m in status.missed
    )
    return (
        f"<h3>Missed days ({len(status.missed)})</h3>"
        '<p class="muted">Scheduled days without a complete run whose run could still delete rows.</p>'
        f'<ul class=\'missed\' data-field="missed" data-value="{len(status.missed)}">{items}</ul>'
        f'<p>{run_them}</p><pre data-field="backfill">{escape(panel.backfill or "")}</pre>{covered}'
    )


def failures_section(panel: PolicyPanel) -> str:
    """What makes the policy failing, in red, before anything else: its target check, or its latest run
    stopped on an error."""
    status = panel.status
    assert status is not None
    failures = status.failures
    if not failures:
        return ""
    items = "".join(
        f'<p class="error" role="alert" data-field="failing" data-kind="{escape(f.kind)}">{escape(f.message)}</p>'
        for f in failures
    )
    return f"<h3>Failing</h3>{items}"


def _age(budget: BudgetView) -> str:
    if budget.observed_at is None:
        return ""
    when = f"observed {human_seconds(budget.age_s)} ago" if budget.age_s is not None else ""
    if budget.live:
        return f"{when}: purges steer by it now"
    return f"{when}: no purge is observing it now; this is what the last one left"


def budget_section(panel: PolicyPanel) -> str:
    """The database budget: its state (batches at once and duty cycle, or paused), why, and the canary
    against its baseline; or why nothing is shown."""
    p = panel.policy
    head = "<h3>Database budget</h3>"
    if not p.budget.enabled:
        return f'{head}<p class="muted" data-field="budget" data-value="off">Off for this policy (budget: false).</p>'
    if panel.budget_error is not None:
        return (
            f'{head}<p class="muted" data-field="budget" data-value="unreadable">The budget cannot be read:'
            f" {escape(panel.budget_error)}</p>"
        )
    b = panel.budget
    if b is None:
        return (
            f'{head}<p class="muted" data-field="budget" data-value="none">Not observed yet: no purge with a ledger'
            f" in <code>{escape(p.ledger_schema)}</code> has run under the budget.</p>"
        )
    state = "paused" if b.paused else ("floor" if b.at_floor else "running")
    css = "budget-paused" if b.paused else ("budget-live" if b.live else "")
    floor = " (its floor)" if b.at_floor and not b.paused else ""
    text = (
        f'<p data-field="budget" data-value="{state}"><strong class="{css}">{escape(b.describe())}</strong>'
        f"{floor} · {escape(b.canary_text())} · {escape(_age(b))} · at most {b.max_workers} batch(es) at once</p>"
    )
    reasons = "".join(f'<li data-field="budget_reason">{escape(r)}</li>' for r in b.reasons)
    if reasons:
        why = "Paused because" if b.paused else "Held by"
        text += f'<p class="muted">{why}:</p><ul class="budget-reasons">{reasons}</ul>'
    return head + text


# The alerts of the SLO (``slo_at_risk``, ``budget_exhausted``): shown in its section.
SLO_ALERTS = frozenset(SLO_KINDS.values())


def _slo_number(value: object, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3g}{unit}" if value < 100 else f"{value:,.0f}{unit}"
    return f"{int(value):,}{unit}" if isinstance(value, (int, float)) else f"{value}{unit}"


def slo_section(panel: PolicyPanel) -> str:
    """The cleanup SLO: rows arriving (λ), a worker's rate under the budget (μ), the concurrency allowed
    (c), and whether c·μ keeps up with λ plus the backlog inside the window; its warnings in yellow."""
    head = "<h3>Cleanup SLO</h3>"
    slo = panel.slo
    if slo is None:
        if panel.slo_error is None:
            return ""
        return f'{head}<p class="muted" data-field="slo" data-value="none">{escape(panel.slo_error)}</p>'
    window = getattr(slo, "window_s", None)
    keeps_up = getattr(slo, "keeps_up", None)
    facts = [
        ("cleanup window", human_seconds(window) if window is not None else "—"),
        ("λ, eligible rows arriving", f"{_slo_number(getattr(slo, 'lambda_rows_per_day', None))} a day"),
        ("μ, one worker under the budget", f"{_slo_number(getattr(slo, 'mu_rows_per_s', None))} rows/s"),
        ("c, concurrency the budget allowed", _slo_number(getattr(slo, "concurrency", None))),
        ("backlog", f"{_slo_number(getattr(slo, 'backlog_rows', None))} rows"),
        ("c·μ over the window", f"{_slo_number(getattr(slo, 'capacity_rows', None))} rows"),
        ("needed in the window", f"{_slo_number(getattr(slo, 'needed_rows', None))} rows"),
        ("at the budget's floor", f"{getattr(slo, 'floor_share', 0) or 0:.0%} of the last run"),
    ]
    verdict = "keeps up" if keeps_up else ("cannot keep up" if keeps_up is not None else "unknown")
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts)
    # The SLO's warnings as ``status`` gives them (the same alerts), under the SLO instead of with the others.
    status = panel.status
    alerts = [w for w in status.warnings if w.kind in SLO_ALERTS] if status is not None else []
    warnings = "".join(
        f'<p class="warning" data-kind="{escape(w.kind)}" data-field="slo_warning">{escape(w.message)}</p>'
        for w in alerts
    )
    state = "keeps_up" if keeps_up else ("behind" if keeps_up is not None else "unknown")
    return (
        f'{head}<p data-field="slo" data-value="{state}">c·μ against λ plus the backlog: <strong>{verdict}</strong>'
        f"</p>{warnings}<dl>{dl}</dl>"
    )


def policy_section(panel: PolicyPanel) -> str:
    p = panel.policy
    head = (
        f'<section class="policy" id="policy-{escape(p.name)}" data-policy="{escape(p.name)}">'
        f"<h2>{escape(p.name)}</h2>"
        f'<p class="muted">{escape(str(p.table))} · keep {escape(str(p.retention))} · schedule'
        f" {escape(str(p.schedule))} · connection <code>{escape(p.conn_id)}</code> · ledger schema"
        f" <code>{escape(p.ledger_schema)}</code> · DAG <code>{escape(panel.dag_id)}</code></p>"
    )
    if panel.error is not None:
        detail = f": {escape(panel.detail)}" if panel.detail else ""
        return (
            f'{head}<h3>Failing</h3><p class="error" role="alert" data-field="error">The ledger of {escape(p.name)}'
            f" cannot be read: {escape(panel.error)}{detail}</p></section>"
        )
    status = panel.status
    assert status is not None
    failures = status.failures
    warnings = "".join(
        f'<p class="warning" data-kind="{escape(w.kind)}">{escape(w.message)}</p>'
        for w in status.warnings
        # The missed days have their own section, with the backfill; failures theirs, in red; the SLO's
        # warnings go with the SLO.
        if w.kind != "missed_run" and w.kind not in SLO_ALERTS and w not in failures
    )
    if not status.runs:
        runs = '<p class="muted">No runs in the ledger yet.</p>'
    else:
        shown = status.runs[:RUNS_IN_TABLE]
        pressure = {k: b.pressure for k, b in panel.run_budgets.items() if b.pressure is not None}
        legend = (
            f'<span><span class="swatch" style="background:{ALLOWED_COLOUR}"></span> allowed (batch slots ×'
            " duty cycle, average over the run)</span>"
            f'<span><span class="swatch" style="background:{CANARY_COLOUR}"></span> canary latency, p90 ×'
            " baseline (shaded: share of the run paused)</span>"
            if pressure
            else ""
        )
        title = "Rows deleted, cleanup lag and database pressure" if pressure else "Rows deleted and cleanup lag"
        runs = (
            f"<h3>{title}, last {len(status.runs)} run(s)</h3>"
            '<p class="legend muted"><span><span class="swatch" style="background:#4f7cac"></span> rows deleted</span>'
            '<span><span class="swatch" style="background:#d9822b"></span> cleanup lag (oldest eligible row'
            f" left, at verification)</span>{legend}</p>"
            f"{runs_chart(status.runs, pressure)}"
            f"<h3>Last {len(shown)} run(s)</h3>{runs_table(p.name, shown, panel.run_budgets)}"
        )
    return (
        f"{head}{failures_section(panel)}{warnings}{budget_section(panel)}{slo_section(panel)}{runs}"
        f"{missed_section(panel)}</section>"
    )


def overview_page(policy_set: PolicySet, panels: Sequence[PolicyPanel], now: datetime) -> str:
    problems = "".join(
        f'<p class="error" role="alert" data-kind="policy_error" data-dag-id="{escape(problem.dag_id)}">'
        f"Invalid policy (DAG <code>{escape(problem.dag_id)}</code> fails at once until it is fixed):"
        f" {escape(problem.message)}</p>"
        for problem in policy_set.problems
    )
    sections = "".join(policy_section(panel) for panel in panels)
    if not panels and not problems:
        sections = '<p class="muted">The policies file holds no policy (or none you may read).</p>'
    source = "" if policy_set.source is None else f"Policies from <code>{escape(str(policy_set.source))}</code> · "
    body = f'<h1>Retention</h1><p class="muted">{source}as of {escape(short(now))}</p>{problems}{sections}'
    return page("Retention", body)


def _chunk_row(chunk: ChunkView) -> str:
    rows = chunk.rows_deleted if chunk.outcome != "dry_run" else chunk.rows_matched
    planned = "—" if chunk.rows_planned is None else f"{chunk.rows_planned:,}"
    return (
        f'<tr data-chunk-key="{escape(chunk.chunk_key)}">'
        f"{_cell('seq', '' if chunk.seq is None else str(chunk.seq))}"
        f"{_cell('range', chunk.range_label)}"
        f"{_cell('state', chunk.state, 'state-' + chunk.state)}"
        f"{_cell('outcome', chunk.outcome or '—')}"
        f"{_num('rows_deleted', rows)}"
        f'<td class="num" data-field="rows_planned">{planned}</td>'
        f"{_num('batches', chunk.batches)}"
        f"{_num('attempts', chunk.attempts)}"
        f"{_cell('last_batch_at', short(chunk.last_batch_at))}"
        f"{_paused_cell(RunBudget(chunk.chunk_key, chunk.paused))}"
        f"{_cell('last_error', chunk.last_error or '')}"
        "</tr>"
    )


def run_page(detail: RunDetail) -> str:
    s = detail.summary
    p = detail.policy
    facts = [
        ("policy", p.name),
        ("DAG", dag_id(p)),
        ("table", str(p.table)),
        ("cutoff", short(s.cutoff)),
        ("state", s.status),
        ("chunks done", f"{s.chunks_complete}/{s.chunks_expected}"),
        ("rows planned", f"{s.rows_planned:,}"),
        ("rows deleted", rows_text(s)),
        ("planned at", short(s.planned_at)),
        ("verified at", short(s.completed_at)),
        ("duration", s.duration_text()),
        ("cleanup lag", lag_text(s)),
    ]
    if detail.budget is not None:
        facts.append(("paused", detail.budget.paused_text()))
        if detail.budget.hold is not None:
            facts.append(("held", detail.budget.hold_text))
    dl = "".join(f'<dt>{escape(k)}</dt><dd data-field="{escape(k)}">{escape(v)}</dd>' for k, v in facts)
    head = (
        "<tr><th>#</th><th>range</th><th>state</th><th>outcome</th><th class='num'>rows</th>"
        "<th class='num'>planned</th><th class='num'>batches</th><th class='num'>attempts</th>"
        "<th>last batch</th><th>paused (by reason)</th><th>last error</th></tr>"
    )
    chunks = "".join(_chunk_row(c) for c in detail.chunks)
    table = f'<table class="chunks">{head}{chunks}</table>' if detail.chunks else '<p class="muted">No chunks.</p>'
    pressure = ""
    if detail.budget is not None:
        legend = (
            '<p class="legend muted">'
            f'<span><span class="swatch" style="background:{CANARY_COLOUR}"></span> canary latency (dashed: its'
            " baseline)</span>"
            f'<span><span class="swatch" style="background:{ALLOWED_COLOUR}"></span> allowed (batch slots × duty'
            " cycle)</span><span>shaded: paused</span></p>"
        )
        chart = run_chart(detail.points, s, lag_text(s), s.planned_at, detail.span_end or s.planned_at)
        pressure = f"<h3>Database pressure during the run</h3>{legend}{chart}"
    body = (
        f'<p><a href="./#policy-{escape(p.name)}">← all policies</a></p>'
        f"<h1>Run <code>{escape(s.run_key)}</code></h1><dl>{dl}</dl>{pressure}"
        f"<h3>Chunks ({len(detail.chunks)})</h3>{table}"
    )
    return page(f"Retention · {s.run_key}", body)


def message_page(
    title: str, message: str, *, link: tuple[str, str] | None = None, alert: bool = False, top: bool = False
) -> str:
    """A page that only says something: a run not found, a ledger that cannot be read, log in first.
    ``top``: the link opens in the top window (the login page), not in the view's frame."""
    css = ' class="error" role="alert"' if alert else ""
    target = ' target="_top"' if top else ""
    extra = f'<p><a href="{escape(link[0])}"{target}>{escape(link[1])}</a></p>' if link else ""
    return page(title, f"<h1>{escape(title)}</h1><p{css}>{escape(message)}</p>{extra}")
