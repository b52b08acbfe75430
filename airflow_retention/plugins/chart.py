"""The charts of the view as inline SVG. No script and nothing fetched: the page must work where nothing
outside is reachable.

- A policy's last runs (:func:`runs_chart`): rows deleted as bars (left scale), cleanup lag as a line (right
  scale), and under them, run by run, the database pressure the budget observed during each run: the share
  of the database it allowed (batch slots times duty cycle, bars), the canary's latency against its
  baseline (p90, a line) and the share of the run it was paused (shaded).
- One run (:func:`run_chart`): the budget's observations over the run's span: the canary and its baseline,
  the share allowed, the periods paused; with the run's cleanup lag beside them.

Each bar and point carries its run's values (``data-run-key``, ``data-rows``, ``data-lag``, ``data-allowed``,
``data-canary-ratio``, ...) and a ``<title>`` the browser shows on hover.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape

from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds
from airflow_retention.plugins.budget import RunPoint, RunPressure

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 70, 70, 14, 40
BAR_COLOUR = "#4f7cac"
LAG_COLOUR = "#d9822b"
ALLOWED_COLOUR = "#8250df"
CANARY_COLOUR = "#cf222e"
PAUSED_COLOUR = "#cf222e"
# The pressure panel under the runs (its height, and the gap above it).
PRESSURE_H, PRESSURE_GAP = 90, 22


def _rows(run: RunSummary) -> int:
    """What a run removed: rows deleted, or rows matched in a dry run."""
    return run.rows_matched if run.kind == "dry-run" else run.rows_deleted


def _compact(n: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:.0f}"


def runs_chart(runs: Sequence[RunSummary], pressure: Mapping[str, RunPressure] | None = None) -> str:
    """The SVG of ``runs`` (newest first, as the ledger report gives them), drawn oldest to newest; with
    ``pressure`` (by run key), the budget's side of each run in a panel under it."""
    ordered = list(reversed(runs))
    if not ordered:
        return '<p class="muted">No runs in the ledger yet.</p>'
    pressure = {k: v for k, v in (pressure or {}).items() if any(r.run_key == k for r in ordered)}
    extra = PRESSURE_GAP + PRESSURE_H if pressure else 0
    height = HEIGHT + extra
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(ordered)
    max_rows = max(max(_rows(r) for r in ordered), 1)
    lags = [r.cleanup_lag_seconds for r in ordered]
    max_lag = max(max((lag for lag in lags if lag is not None), default=0.0), 1.0)

    def y_rows(n: float) -> float:
        return TOP + plot_h - plot_h * n / max_rows

    def y_lag(seconds: float) -> float:
        return TOP + plot_h - plot_h * seconds / max_lag

    what = "Rows deleted, cleanup lag and database pressure" if pressure else "Rows deleted and cleanup lag"
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {height}" width="100%"'
        f' xmlns="http://www.w3.org/2000/svg" data-runs="{len(ordered)}">',
        f"<title>{what} of the last {len(ordered)} run(s)</title>",
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="#999"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" class="axis">{_compact(max_rows)}</text>',
        f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end" class="axis">0</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{TOP + 4}" class="axis lag">{escape(human_seconds(max_lag))}</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{TOP + plot_h}" class="axis lag">0 s</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" class="axis" text-anchor="middle"'
        f' transform="rotate(-90 14 {TOP + plot_h / 2})">rows deleted</text>',
        f'<text x="{WIDTH - 10}" y="{TOP + plot_h / 2}" class="axis lag" text-anchor="middle"'
        f' transform="rotate(90 {WIDTH - 10} {TOP + plot_h / 2})">cleanup lag</text>',
    ]
    for i, run in enumerate(ordered):
        rows = _rows(run)
        x = LEFT + i * slot + slot * 0.15
        top = y_rows(rows)
        lag = "not measured" if run.cleanup_lag_seconds is None else human_seconds(run.cleanup_lag_seconds)
        tip = f"cutoff {run.cutoff:%Y-%m-%d %H:%M}Z: {rows:,} row(s) deleted, cleanup lag {lag}"
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{top:.1f}" width="{slot * 0.7:.1f}"'
            f' height="{TOP + plot_h - top:.1f}" fill="{BAR_COLOUR}" data-run-key="{escape(run.run_key)}"'
            f' data-rows="{rows}"><title>{escape(tip)}</title></rect>'
        )
    segment: list[str] = []
    segments: list[list[str]] = []
    for i, run in enumerate(ordered):
        if run.cleanup_lag_seconds is None:
            segments.append(segment)
            segment = []
            continue
        x, y = LEFT + (i + 0.5) * slot, y_lag(run.cleanup_lag_seconds)
        segment.append(f"{x:.1f},{y:.1f}")
        parts.append(
            f'<circle class="lag-point" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{LAG_COLOUR}"'
            f' data-run-key="{escape(run.run_key)}" data-lag="{run.cleanup_lag_seconds:g}">'
            f"<title>cutoff {run.cutoff:%Y-%m-%d %H:%M}Z: cleanup lag"
            f" {escape(human_seconds(run.cleanup_lag_seconds))}</title></circle>"
        )
    segments.append(segment)
    for points in segments:
        if len(points) > 1:
            parts.append(f'<polyline fill="none" stroke="{LAG_COLOUR}" stroke-width="2" points="{" ".join(points)}"/>')
    if pressure:
        parts += _pressure_panel(ordered, pressure, TOP + plot_h + PRESSURE_GAP, slot)
    first, last = ordered[0].cutoff, ordered[-1].cutoff
    parts += [
        f'<text x="{LEFT}" y="{height - 20}" class="axis">{first:%Y-%m-%d}</text>',
        f'<text x="{LEFT + plot_w}" y="{height - 20}" class="axis" text-anchor="end">{last:%Y-%m-%d}</text>',
        f'<text x="{LEFT + plot_w / 2}" y="{height - 4}" class="axis" text-anchor="middle">cutoff</text>',
        "</svg>",
    ]
    return "".join(parts)


def _pressure_panel(
    ordered: Sequence[RunSummary], pressure: Mapping[str, RunPressure], top: float, slot: float
) -> list[str]:
    """Under each run's bar: the share of the database the budget allowed during it (batch slots times
    duty cycle, averaged; left scale), the canary's p90 against its baseline (right scale; the dashed line
    is the baseline) and, shaded, the share of the run the budget was paused."""
    plot_w, h = WIDTH - LEFT - RIGHT, PRESSURE_H
    bottom = top + h
    max_allowed = max(max(p.allowed_max for p in pressure.values()), 1.0)
    ratios = [p.canary_ratio_p90 for p in pressure.values() if p.canary_ratio_p90 is not None]
    max_ratio = max(max(ratios, default=0.0), 2.0)

    def y_ratio(r: float) -> float:
        return bottom - h * r / max_ratio

    parts = [
        f'<g class="pressure" data-max-allowed="{max_allowed:g}">',
        f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + plot_w}" y2="{bottom}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{y_ratio(1.0):.1f}" x2="{LEFT + plot_w}" y2="{y_ratio(1.0):.1f}"'
        f' stroke="{CANARY_COLOUR}" stroke-dasharray="3 3" stroke-opacity="0.5"/>',
        f'<text x="{LEFT - 6}" y="{top + 4}" text-anchor="end" class="axis">{max_allowed:g}</text>',
        f'<text x="{LEFT - 6}" y="{bottom}" text-anchor="end" class="axis">0</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{top + 4}" class="axis canary">{max_ratio:.3g}x</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{y_ratio(1.0) + 4:.1f}" class="axis canary">1x</text>',
        f'<text x="14" y="{top + h / 2}" class="axis" text-anchor="middle"'
        f' transform="rotate(-90 14 {top + h / 2})">allowed</text>',
        f'<text x="{WIDTH - 10}" y="{top + h / 2}" class="axis canary" text-anchor="middle"'
        f' transform="rotate(90 {WIDTH - 10} {top + h / 2})">canary</text>',
    ]
    points: list[str] = []
    segments: list[list[str]] = []
    for i, run in enumerate(ordered):
        p = pressure.get(run.run_key)
        if p is None:
            segments.append(points)
            points = []
            continue
        key = escape(run.run_key)
        tip = escape(f"cutoff {run.cutoff:%Y-%m-%d %H:%M}Z: {p.text()} ({p.observations} observation(s))")
        if p.paused_share:
            parts.append(
                f'<rect class="paused-share" x="{LEFT + i * slot:.1f}" y="{top:.1f}" width="{slot:.1f}"'
                f' height="{h * p.paused_share:.1f}" fill="{PAUSED_COLOUR}" fill-opacity="0.18"'
                f' data-run-key="{key}" data-paused-share="{p.paused_share:g}"><title>{tip}</title></rect>'
            )
        bar_top = bottom - h * p.allowed_mean / max_allowed
        parts.append(
            f'<rect class="allowed" x="{LEFT + i * slot + slot * 0.3:.1f}" y="{bar_top:.1f}" width="{slot * 0.4:.1f}"'
            f' height="{bottom - bar_top:.1f}" fill="{ALLOWED_COLOUR}" data-run-key="{key}"'
            f' data-allowed="{p.allowed_mean:g}"><title>{tip}</title></rect>'
        )
        if p.canary_ratio_p90 is not None:
            x, y = LEFT + (i + 0.5) * slot, y_ratio(p.canary_ratio_p90)
            points.append(f"{x:.1f},{y:.1f}")
            parts.append(
                f'<circle class="canary-point" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{CANARY_COLOUR}"'
                f' data-run-key="{key}" data-canary-ratio="{p.canary_ratio_p90:g}"><title>{tip}</title></circle>'
            )
    segments.append(points)
    for line in segments:
        if len(line) > 1:
            joined = " ".join(line)
            parts.append(f'<polyline fill="none" stroke="{CANARY_COLOUR}" stroke-width="1.5" points="{joined}"/>')
    parts.append("</g>")
    return parts


def run_chart(points: Sequence[RunPoint], run: RunSummary, lag: str, start: datetime, end: datetime) -> str:
    """The budget's observations over one run's span (``start`` to ``end``): the canary's latency (red)
    against its baseline (dashed), left scale; the share of the database allowed (batch slots times duty
    cycle, purple steps), right scale; the periods paused shaded; the run's cleanup lag (``lag``, as the
    page writes it) beside them."""
    if not points:
        return '<p class="muted" data-field="pressure">The database budget recorded no observation during this run.</p>'
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    start, end = min(start, points[0].at), max(end, points[-1].at)
    span = max((end - start).total_seconds(), 1.0)
    canaries = [p.canary_ms for p in points if p.canary_ms is not None]
    baselines = [p.baseline_ms for p in points if p.baseline_ms is not None]
    max_ms = max(max(canaries + baselines, default=1.0), 1.0) * 1.1
    max_allowed = max(max(p.allowed for p in points), 1.0)

    def x_at(at: datetime) -> float:
        return LEFT + plot_w * (at - start).total_seconds() / span

    def y_ms(ms: float) -> float:
        return TOP + plot_h - plot_h * ms / max_ms

    def y_allowed(a: float) -> float:
        return TOP + plot_h - plot_h * a / max_allowed

    paused = sum(1 for p in points if p.paused)
    parts = [
        f'<svg class="chart run-chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="100%"'
        f' xmlns="http://www.w3.org/2000/svg" data-points="{len(points)}" data-paused-points="{paused}">',
        f"<title>Database pressure during run {escape(run.run_key)}; cleanup lag {escape(lag)}</title>",
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="#999"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" class="axis canary">{max_ms:.3g} ms</text>',
        f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end" class="axis">0</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{TOP + 4}" class="axis allowed">{max_allowed:g}</text>',
        f'<text x="{LEFT + plot_w + 6}" y="{TOP + plot_h}" class="axis allowed">0</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" class="axis canary" text-anchor="middle"'
        f' transform="rotate(-90 14 {TOP + plot_h / 2})">canary latency</text>',
        f'<text x="{WIDTH - 10}" y="{TOP + plot_h / 2}" class="axis allowed" text-anchor="middle"'
        f' transform="rotate(90 {WIDTH - 10} {TOP + plot_h / 2})">allowed</text>',
    ]
    for i, p in enumerate(points):
        if p.paused:
            # A pause holds until the next observation (the last one: a couple of pixels).
            x0 = x_at(p.at)
            x1 = x_at(points[i + 1].at) if i + 1 < len(points) else x0
            width = min(max(x1 - x0, 2.0), LEFT + plot_w - x0 + 2)
            parts.append(
                f'<rect class="paused" x="{x0:.1f}" y="{TOP}" width="{width:.1f}"'
                f' height="{plot_h}" fill="{PAUSED_COLOUR}" fill-opacity="0.15" data-at="{p.at.isoformat()}">'
                f"<title>{p.at:%H:%M:%S}Z: paused</title></rect>"
            )
    allowed: list[str] = []
    previous: float | None = None
    for p in points:
        x, y = x_at(p.at), y_allowed(p.allowed)
        if previous is not None:  # a step line: the budget holds until the next observation
            allowed.append(f"{x:.1f},{previous:.1f}")
        allowed.append(f"{x:.1f},{y:.1f}")
        previous = y
    parts.append(
        f'<polyline class="allowed" fill="none" stroke="{ALLOWED_COLOUR}" stroke-width="2"'
        f' points="{" ".join(allowed)}"/>'
    )
    base = [f"{x_at(p.at):.1f},{y_ms(p.baseline_ms):.1f}" for p in points if p.baseline_ms is not None]
    if len(base) > 1:
        parts.append(
            f'<polyline class="baseline" fill="none" stroke="{CANARY_COLOUR}" stroke-dasharray="4 3"'
            f' stroke-opacity="0.6" points="{" ".join(base)}"/>'
        )
    canary = []
    for p in points:
        if p.canary_ms is None:
            continue
        x, y = x_at(p.at), y_ms(p.canary_ms)
        canary.append(f"{x:.1f},{y:.1f}")
        state = "paused" if p.paused else f"{p.concurrency} batch(es) at once, busy {p.duty:.0%}"
        base_text = "" if p.baseline_ms is None else f" (baseline {p.baseline_ms:.1f} ms)"
        parts.append(
            f'<circle class="canary-point" cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{CANARY_COLOUR}"'
            f' data-at="{p.at.isoformat()}" data-canary="{p.canary_ms:g}" data-allowed="{p.allowed:g}">'
            f"<title>{p.at:%H:%M:%S}Z: canary {p.canary_ms:.1f} ms{base_text}; {state}</title></circle>"
        )
    if len(canary) > 1:
        parts.append(f'<polyline fill="none" stroke="{CANARY_COLOUR}" stroke-width="1.5" points="{" ".join(canary)}"/>')
    parts += [
        f'<text x="{LEFT}" y="{HEIGHT - 20}" class="axis">{start:%H:%M:%S}Z</text>',
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 20}" class="axis" text-anchor="end">{end:%H:%M:%S}Z</text>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 20}" class="axis lag" text-anchor="middle" data-chart="lag">'
        f"cleanup lag {escape(lag)}</text>",
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" class="axis" text-anchor="middle">time (UTC)</text>',
        "</svg>",
    ]
    return "".join(parts)
