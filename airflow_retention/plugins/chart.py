"""The chart of a policy's last runs as inline SVG: rows deleted as bars (left scale), cleanup lag as a line
(right scale). No script and nothing fetched: the page must work where nothing outside is reachable.

Each bar and each lag point carries its run's values (``data-run-key``, ``data-rows``, ``data-lag``) and a
``<title>`` the browser shows on hover.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 70, 70, 14, 40
BAR_COLOUR = "#4f7cac"
LAG_COLOUR = "#d9822b"


def _rows(run: RunSummary) -> int:
    """What a run removed: rows deleted, or rows matched in a dry run."""
    return run.rows_matched if run.kind == "dry-run" else run.rows_deleted


def _compact(n: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:.0f}"


def runs_chart(runs: Sequence[RunSummary]) -> str:
    """The SVG of ``runs`` (newest first, as the ledger report gives them), drawn oldest to newest."""
    ordered = list(reversed(runs))
    if not ordered:
        return '<p class="muted">No runs in the ledger yet.</p>'
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(ordered)
    max_rows = max(max(_rows(r) for r in ordered), 1)
    lags = [r.cleanup_lag_seconds for r in ordered]
    max_lag = max(max((lag for lag in lags if lag is not None), default=0.0), 1.0)

    def y_rows(n: float) -> float:
        return TOP + plot_h - plot_h * n / max_rows

    def y_lag(seconds: float) -> float:
        return TOP + plot_h - plot_h * seconds / max_lag

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="100%"'
        f' xmlns="http://www.w3.org/2000/svg" data-runs="{len(ordered)}">',
        f"<title>Rows deleted and cleanup lag of the last {len(ordered)} run(s)</title>",
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
    first, last = ordered[0].cutoff, ordered[-1].cutoff
    parts += [
        f'<text x="{LEFT}" y="{HEIGHT - 20}" class="axis">{first:%Y-%m-%d}</text>',
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 20}" class="axis" text-anchor="end">{last:%Y-%m-%d}</text>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" class="axis" text-anchor="middle">cutoff</text>',
        "</svg>",
    ]
    return "".join(parts)
