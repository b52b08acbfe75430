"""Run summaries and progress read from the ledger through the public :class:`Ledger` API: one
:class:`RunSummary` per run (totals from the run row once verified, else from its chunks), and the
:class:`Progress` of a run being purged (``status --watch``).

Nothing here writes. The values are plain dataclasses; ``to_json`` methods give the stable ``--json`` form.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_retention.cli.timefmt import human_seconds, iso


def run_kind(run_key: str) -> str:
    """``lone`` (chunks purged without a planner), ``dry-run`` or ``planned``."""
    if run_key.endswith("#lone"):
        return "lone"
    if run_key.endswith("#dry-run"):
        return "dry-run"
    return "planned"


@dataclass(frozen=True)
class ChunkProblem:
    chunk_key: str
    state: str
    last_error: str | None
    last_batch_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "chunk_key": self.chunk_key,
            "state": self.state,
            "last_error": self.last_error,
            "last_batch_at": iso(self.last_batch_at),
        }


@dataclass(frozen=True)
class RunSummary:
    """One ledger run with its progress: totals from the run row once verified, else from its chunks."""

    run_key: str
    kind: str
    cutoff: datetime
    state: str
    chunks_expected: int
    chunks_complete: int
    rows_planned: int
    rows_deleted: int
    rows_matched: int
    rows_archived: int
    planned_at: datetime
    completed_at: datetime | None
    last_batch_at: datetime | None
    duration_seconds: float | None
    cleanup_lag_seconds: float | None
    eligible_left: int | None
    oldest_eligible_at: datetime | None
    chunk_problems: tuple[ChunkProblem, ...] = ()
    # A partitioned table's leaves with eligible rows the run's plan left out (past the chunk budget).
    leaves_deferred: tuple[str, ...] = ()

    @property
    def chunks_done(self) -> bool:
        return self.chunks_complete >= self.chunks_expected

    @property
    def running(self) -> bool:
        """Planned and not every chunk complete yet (a lone run never is verified: it runs while a chunk is
        incomplete)."""
        return self.state != "complete" and not self.chunks_done

    @property
    def status(self) -> str:
        """The state in words: complete, running, or chunks done but not verified yet."""
        if self.state == "complete" and self.leaves_deferred:
            return f"complete, {len(self.leaves_deferred)} leaf partition(s) not covered"
        if self.state == "complete":
            return "complete"
        if self.kind == "lone":
            return "lone, chunks complete" if self.chunks_done else "lone, running"
        return "planned, chunks complete, not verified" if self.chunks_done else "planned"

    def duration_text(self) -> str:
        if self.duration_seconds is None:
            return "—"
        text = human_seconds(self.duration_seconds, precise=True)
        return f"running for {text}" if self.running else text

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "kind": self.kind,
            "cutoff": iso(self.cutoff),
            "state": self.state,
            "status": self.status,
            "running": self.running,
            "chunks_expected": self.chunks_expected,
            "chunks_complete": self.chunks_complete,
            "rows_planned": self.rows_planned,
            "rows_deleted": self.rows_deleted,
            "rows_matched": self.rows_matched,
            "rows_archived": self.rows_archived,
            "planned_at": iso(self.planned_at),
            "completed_at": iso(self.completed_at),
            "last_batch_at": iso(self.last_batch_at),
            "duration_seconds": self.duration_seconds,
            "cleanup_lag_seconds": self.cleanup_lag_seconds,
            "eligible_left": self.eligible_left,
            "oldest_eligible_at": iso(self.oldest_eligible_at),
            "chunk_errors": [p.to_json() for p in self.chunk_problems if p.last_error],
            "leaves_deferred": list(self.leaves_deferred),
        }


def summarize_run(run: dict[str, Any], chunks: list[dict[str, Any]] | None, now: datetime) -> RunSummary:
    """A run row (``Ledger.get_run``/``recent_runs``) and, for a run not verified yet, its chunk rows."""
    kind = run_kind(run["run_key"])
    verified = run["state"] == "complete" and chunks is None
    if verified:
        complete, deleted = run["chunks_completed"] or 0, run["rows_deleted"] or 0
        matched, archived = run["rows_matched"] or 0, run["rows_archived"] or 0
        last_batch = run["completed_at"]
    else:
        rows = chunks or []
        complete = sum(1 for c in rows if c["state"] == "complete")
        deleted = sum(c["rows_deleted"] for c in rows)
        matched = sum(c["rows_matched"] for c in rows)
        archived = sum(c["rows_archived"] for c in rows)
        last_batch = max((c["last_batch_at"] for c in rows if c["last_batch_at"]), default=None)
    expected = run["chunks_expected"] if kind != "lone" else len(chunks or [])
    rows_planned = run["rows_planned"] if kind != "lone" else sum(c["rows_planned"] or 0 for c in chunks or [])
    return RunSummary(
        run_key=run["run_key"],
        kind=kind,
        cutoff=run["cutoff"],
        state=run["state"],
        chunks_expected=int(expected),
        chunks_complete=int(complete),
        rows_planned=int(rows_planned),
        rows_deleted=int(deleted),
        rows_matched=int(matched),
        rows_archived=int(archived),
        planned_at=run["planned_at"],
        completed_at=run["completed_at"],
        last_batch_at=last_batch,
        duration_seconds=_duration(run, chunks, now),
        cleanup_lag_seconds=run["cleanup_lag_seconds"],
        eligible_left=run["eligible_left"],
        oldest_eligible_at=run["oldest_eligible_at"],
        chunk_problems=tuple(_problems(chunks or [])),
        leaves_deferred=tuple(run.get("leaves_deferred") or ()),
    )


def _duration(run: dict[str, Any], chunks: list[dict[str, Any]] | None, now: datetime) -> float | None:
    """Planned to verified; for a run not verified, planned to its last completed chunk when every chunk
    is complete, else planned to now (running for ...)."""
    if run["completed_at"] is not None:
        return (run["completed_at"] - run["planned_at"]).total_seconds()
    rows = chunks or []
    if rows and all(c["state"] == "complete" for c in rows) and len(rows) >= run["chunks_expected"]:
        return (max(c["completed_at"] for c in rows) - run["planned_at"]).total_seconds()
    return (now - run["planned_at"]).total_seconds()


def _problems(chunks: list[dict[str, Any]]) -> list[ChunkProblem]:
    return [
        ChunkProblem(c["chunk_key"], c["state"], c["last_error"], c["last_batch_at"])
        for c in chunks
        if c["state"] != "complete"
    ]


def load_runs(conn: Any, ledger: Any, policy_name: str, limit: int, now: datetime) -> list[RunSummary]:
    """The policy's last ``limit`` runs, newest cutoff first. Chunk rows are read only for runs not
    verified yet (one query each)."""
    runs = ledger.recent_runs(conn, policy_name, limit=limit)
    runs.sort(key=lambda r: (r["cutoff"], r["planned_at"]), reverse=True)
    return [
        summarize_run(run, ledger.chunk_rows(conn, run["run_key"]) if run["state"] != "complete" else None, now)
        for run in runs
    ]


@dataclass(frozen=True)
class Progress:
    """How far a run's purge is: chunks complete of expected, rows done (deleted, or matched in a dry run)
    of rows planned."""

    run_key: str
    state: str
    chunks_expected: int
    chunks_complete: int
    chunks_running: int
    rows_planned: int
    rows_done: int
    errors: tuple[ChunkProblem, ...] = ()

    @property
    def done(self) -> bool:
        return self.state == "complete" or self.chunks_complete >= self.chunks_expected

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "state": self.state,
            "done": self.done,
            "chunks_expected": self.chunks_expected,
            "chunks_complete": self.chunks_complete,
            "chunks_running": self.chunks_running,
            "rows_planned": self.rows_planned,
            "rows_done": self.rows_done,
            "chunk_errors": [e.to_json() for e in self.errors],
        }


def progress_of(run: dict[str, Any], chunks: list[dict[str, Any]]) -> Progress:
    """Progress from a run row and its chunk rows (pure: testable without a database)."""
    dry = run["run_key"].endswith("#dry-run")
    lone = run["run_key"].endswith("#lone")
    return Progress(
        run_key=run["run_key"],
        state=run["state"],
        chunks_expected=len(chunks) if lone else int(run["chunks_expected"]),
        chunks_complete=sum(1 for c in chunks if c["state"] == "complete"),
        chunks_running=sum(1 for c in chunks if c["state"] == "running"),
        rows_planned=sum(int(c["rows_planned"] or 0) for c in chunks) if lone else int(run["rows_planned"]),
        rows_done=sum(int(c["rows_matched"] if dry else c["rows_deleted"]) for c in chunks),
        errors=tuple(p for p in _problems(chunks) if p.last_error),
    )


def run_progress(conn: Any, ledger: Any, run_key: str) -> Progress | None:
    run = ledger.get_run(conn, run_key)
    if run is None:
        return None
    return progress_of(run, ledger.chunk_rows(conn, run_key))


def running_run_keys(conn: Any, ledger: Any, policy_name: str, limit: int = 20) -> list[str]:
    """The policy's recent planned runs whose chunks are not all complete (lone runs left out)."""
    keys = []
    for run in ledger.recent_runs(conn, policy_name, limit=limit):
        if run["state"] == "complete" or run_kind(run["run_key"]) == "lone":
            continue
        progress = progress_of(run, ledger.chunk_rows(conn, run["run_key"]))
        if not progress.done:
            keys.append(run["run_key"])
    return keys
