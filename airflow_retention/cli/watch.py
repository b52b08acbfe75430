"""Follow running purges: a ``rich`` progress bar per run (chunks complete of expected, rows deleted of
rows planned), refreshed from the ledger until every chunk is complete, the iteration limit is reached,
or Ctrl-C. With ``--json`` each refresh is one JSON line instead."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from airflow_retention.cli.runs import Progress, run_progress
from airflow_retention.cli.timefmt import iso


def poll(conn: Any, ledger: Any, run_keys: Sequence[str]) -> list[Progress]:
    """The progress of each run that is (still) in the ledger."""
    found = (run_progress(conn, ledger, key) for key in run_keys)
    return [p for p in found if p is not None]


def follow(
    conn: Any,
    ledger: Any,
    run_keys: Sequence[str],
    *,
    console: Any | None,
    interval: float = 1.0,
    iterations: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Progress]:
    """Refresh every ``interval`` seconds until every run's chunks are complete (or ``iterations`` polls, or
    Ctrl-C); draw bars on ``console``, or print JSON lines when it is None. Returns the last progress."""
    if console is None:
        return _follow_json(conn, ledger, run_keys, interval, iterations, sleep)
    from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn
    from rich.progress import Progress as Bars

    bars = Bars(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        auto_refresh=False,
    )
    tasks: dict[tuple[str, str], Any] = {}
    latest: list[Progress] = []
    with bars:
        for latest in _polls(conn, ledger, run_keys, interval, iterations, sleep):
            for progress in latest:
                _draw(bars, tasks, progress)
            bars.refresh()
    return latest


def _draw(bars: Any, tasks: dict[tuple[str, str], Any], p: Progress) -> None:
    for kind, done, total in (("chunks", p.chunks_complete, p.chunks_expected), ("rows", p.rows_done, p.rows_planned)):
        key = (p.run_key, kind)
        if key not in tasks:
            label = f"{p.run_key} {kind}" if kind == "chunks" else f"{' ' * len(p.run_key)} {kind}"
            tasks[key] = bars.add_task(label, total=max(total, 1), note="")
        note = ""
        if kind == "chunks":
            note = "done" if p.done else f"{p.chunks_running} running"
            if p.errors:
                note += f", {len(p.errors)} with errors"
        bars.update(tasks[key], completed=min(done, max(total, 1)) if total else (1 if p.done else 0), note=note)


def _follow_json(
    conn: Any,
    ledger: Any,
    run_keys: Sequence[str],
    interval: float,
    iterations: int | None,
    sleep: Callable[[float], None],
) -> list[Progress]:
    from airflow_retention.cli.render import emit_json_line

    latest: list[Progress] = []
    for latest in _polls(conn, ledger, run_keys, interval, iterations, sleep):
        emit_json_line({"time": iso(datetime.now(timezone.utc)), "runs": [p.to_json() for p in latest]})
    return latest


def _polls(
    conn: Any,
    ledger: Any,
    run_keys: Sequence[str],
    interval: float,
    iterations: int | None,
    sleep: Callable[[float], None],
) -> Any:
    count = 0
    try:
        while True:
            progress = poll(conn, ledger, run_keys)
            count += 1
            yield progress
            if all(p.done for p in progress) or (iterations is not None and count >= iterations):
                return
            sleep(interval)
    except KeyboardInterrupt:
        return
