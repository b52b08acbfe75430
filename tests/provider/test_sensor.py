"""The verify task's own words on a run, with the ledger's answer given (no DAG run needed)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_retention.core.policy.model import RetentionPolicy
from tests.core.helpers import policy_data

pytestmark = pytest.mark.airflow


class _Hook:
    """What the sensor asks the ledger when it completes a run, answered with ``run``."""

    def __init__(self, run: dict[str, Any]) -> None:
        self.run = run

    def complete_run(self, run_key: str, verified_by: str) -> dict[str, Any]:
        return self.run


class _Lines:
    """A task logger that keeps its lines (level, text)."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []

    def log(self, level: int, message: str, *args: Any) -> None:
        self.lines.append((level, message % args))

    def info(self, message: str, *args: Any) -> None:
        self.log(logging.INFO, message, *args)

    def warning(self, message: str, *args: Any, **_: Any) -> None:
        self.log(logging.WARNING, message, *args)


def test_a_run_done_with_leaves_past_the_chunk_budget_is_a_warning_never_a_plain_complete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_retention.sensors.retention import RetentionCompleteSensor

    policy = RetentionPolicy.from_dict(policy_data("s", table="s.t", chunk_by="block", key_column=None, condition=None))
    info = {"run_key": "events_purge@2024-06-01T12:00:00Z", "cutoff": "2024-06-01T12:00:00Z", "chunk_keys": ["a", "b"]}
    sensor = RetentionCompleteSensor(task_id="verify", policy=policy, run_info=info)
    at = datetime(2024, 7, 1, tzinfo=timezone.utc)
    run = {
        "run_key": info["run_key"],
        "planned_at": at,
        "completed_at": at,
        "chunks_completed": 2,
        "chunks_expected": 2,
        "rows_deleted": 1234,
        "rows_matched": 0,
        "leaves_deferred": ["s.t_h2", "s.t_h3"],
    }
    sensor.__dict__["hook"] = _Hook(run)
    monkeypatch.setattr(sensor, "_report_leftovers", lambda context, run: None)
    monkeypatch.setattr(sensor, "_report_missed_runs", lambda context: None)
    # The task's logger goes through Airflow's structlog, past caplog: the lines are kept here instead.
    lines = _Lines()
    monkeypatch.setattr(RetentionCompleteSensor, "log", lines)
    context = {"ti": SimpleNamespace(dag_id="d", run_id="r", map_index=-1, try_number=1, hostname="h")}
    done = sensor._complete(context, info["run_key"], ["a", "b"])
    said = (
        "2 chunk(s) complete, 1,234 row(s) deleted at cutoff 2024-06-01T12:00:00Z; 2 leaf partition(s) with eligible"
        " rows not covered by this run (past the chunk budget of 2; max_map_length): s.t_h2, s.t_h3 — the next run"
        " plans them first"
    )
    assert done["outcome"] == said and done["leaves_deferred"] == ["s.t_h2", "s.t_h3"]
    assert [level for level, text in lines.lines if said in text] == [logging.WARNING]

    # Every leaf covered: the plain line, at INFO.
    sensor.__dict__["hook"] = _Hook({**run, "leaves_deferred": []})
    lines.lines.clear()
    done = sensor._complete(context, info["run_key"], ["a", "b"])
    assert done["outcome"] == "2 chunk(s) complete, 1,234 row(s) deleted at cutoff 2024-06-01T12:00:00Z"
    assert [level for level, text in lines.lines if done["outcome"] in text] == [logging.INFO]
