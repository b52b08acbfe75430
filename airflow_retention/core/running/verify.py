"""Verification of a run: the expected chunk set against the ledger, in words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.db.catalog import inspect_target
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning import tenants
from airflow_retention.core.planning.cutoff import as_utc
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import MAX_KEY, MIN_KEY
from airflow_retention.core.sql.reads import leftover_statement
from airflow_retention.core.sql.target import TargetInfo

# The missed-run report (verify task, CLI, view) looks back this far; ledger_keep_days keeps at least this much.
MISSED_RUNS_WINDOW = timedelta(days=31)
# Seen from now (CLI, view), a scheduled date counts as missed once this much time has passed without a
# complete run: its run may be starting.
MISSED_RUNS_GRACE = timedelta(hours=1)
# Counting what is left stops here: the number is a signal, not an inventory.
LEFTOVER_CAP = 100_000
# A run that deleted more rows leaves its cleanup lag to the next run's planning (lag_left_to_next_run);
# below it the verify measures at once, within LAG_AT_VERIFY_TIMEOUT_MS (else the next run does).
LAG_AT_VERIFY_ROWS = 200_000
LAG_AT_VERIFY_TIMEOUT_MS = 2_000


@dataclass(frozen=True)
class Verification:
    """A run's expected chunks against the ledger.

    :param complete: expected chunks whose ledger row is ``complete`` (with or without dead letters).
    :param missing: what is not complete: expected chunks not complete (or without a ledger row), and
        disagreements between the plan and the ledger.
    :param left: open dead letters, ``"<chunk key> (tenant T left: <cause>)"``: tenants of a chunk whose
        rows were left behind (the chunk itself is complete, its other tenants purged). They keep the
        run from being complete like a missing chunk does.
    :param deferred: a partitioned table's leaves with eligible rows that the plan left out, past the
        chunk budget (``runs.leaves_deferred``). They do not keep the run from being ``ok`` (its planned
        chunks are all it will ever do; failing every night would not get them purged sooner: the next
        run plans them first), but :meth:`describe` never calls such a run plainly complete, and
        :attr:`covers_all` is false.
    """

    run_key: str
    expected: int
    complete: int
    missing: list[str] = field(default_factory=list)
    rows_deleted: int = 0
    run_found: bool = True
    left: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every planned chunk complete, no tenant left: nothing more will happen in this run."""
        return self.run_found and not self.missing and not self.left

    @property
    def covers_all(self) -> bool:
        """Whether the run's plan took every leaf with eligible rows (no leaf deferred past the budget)."""
        return not self.deferred

    def describe(self) -> str:
        if not self.run_found:
            return f"run {self.run_key}: not in the ledger (never planned)"
        if self.ok and self.deferred:
            return (
                f"run {self.run_key}: all {self.expected} planned chunk(s) complete,"
                f" {self.rows_deleted:,} row(s) deleted; {not_covered(self.deferred, self.expected)}"
            )
        if self.ok:
            return (
                f"run {self.run_key}: all {self.expected} expected chunk(s) complete,"
                f" {self.rows_deleted} row(s) deleted"
            )
        # A chunk with a dead letter is complete in the ledger, yet the run is not done: say which is which.
        text = f"run {self.run_key}: {self.complete} of {self.expected} expected chunk(s) complete"
        if self.left:
            chunks = len({item.split(" (tenant ", 1)[0] for item in self.left})
            text += f", {chunks} chunk(s) with tenant(s) left as dead letters"
        if self.missing:
            text += f"; missing: {_listed(self.missing)}"
        if self.left:
            text += f"; dead letters (tenants not purged): {_listed(self.left)}"
        if self.deferred:
            text += f"; {not_covered(self.deferred, self.expected)}"
        return text


def _listed(items: Sequence[str]) -> str:
    return ", ".join(items[:20]) + (" …" if len(items) > 20 else "")


def not_covered(leaves: Sequence[str], budget: int) -> str:
    """What a run whose plan deferred ``leaves`` past the chunk budget did not do, in words (the verify,
    the sensor's log, the CLI). ``budget``: the run's planned chunks, which such a plan always fills."""
    return (
        f"{len(leaves)} leaf partition(s) with eligible rows not covered by this run (past the chunk budget"
        f" of {budget}; max_map_length): {_listed(leaves)} — the next run plans them first"
    )


def verify_run(conn: Any, ledger: Ledger, run_key: str, expected_keys: Sequence[str] | None = None) -> Verification:
    """Compare the expected chunk keys (the plan handed to the chunk tasks; the ledger's own list when
    not given) with the chunks the ledger shows complete. A chunk marked "success" in the UI without
    running is missing here, and so is a chunk whose ledger row is gone."""
    run = ledger.get_run(conn, run_key)
    if run is None:
        return Verification(run_key, len(expected_keys or ()), 0, list(expected_keys or ()), run_found=False)
    rows = {r["chunk_key"]: r for r in ledger.chunk_rows(conn, run_key)}
    expected = list(expected_keys) if expected_keys is not None else list(rows)
    complete = [k for k in expected if k in rows and rows[k]["state"] == "complete"]
    missing = [k if k in rows else f"{k} (no ledger row)" for k in expected if k not in complete]
    if expected_keys is None and run["chunks_expected"] > len(rows):
        missing.append(f"{run['chunks_expected'] - len(rows)} chunk row(s) deleted from the ledger")
    with dbapi.transaction(conn) as cur:
        letters = ledger.open_dead_letters(cur, run_key)
    left = [f"{d['chunk_key']} (tenant {d['tenant']} left: {d['failure_class']})" for d in letters]
    if expected_keys is not None and len(expected_keys) != run["chunks_expected"]:
        missing.append(
            f"the plan handed out {len(expected_keys)} chunk(s), the ledger's plan has {run['chunks_expected']}"
        )
    return Verification(
        run_key=run_key,
        expected=len(expected),
        complete=len(complete),
        missing=missing,
        rows_deleted=sum(rows[k]["rows_deleted"] for k in complete),
        left=left,
        deferred=list(run["leaves_deferred"] or ()),
    )


@dataclass(frozen=True)
class Leftovers:
    """What a run left eligible before its cutoff: the cleanup lag, the SLO signal.

    ``lag_seconds`` is how long before the cutoff the oldest row still eligible expired (0 when none
    is left): how far the table is behind its policy at the end of the run. ``since`` is where the walk
    began (the lag window, see :func:`measure_leftovers`); None: from the oldest row.
    """

    oldest: datetime | None
    count: int
    lag_seconds: float
    since: datetime | None = None

    @property
    def capped(self) -> bool:
        return self.count >= LEFTOVER_CAP

    def describe(self, cutoff: datetime) -> str:
        window = f" (rows from {self.since:%Y-%m-%d %H:%M:%S}Z checked)" if self.since is not None else ""
        if not self.count:
            return f"no eligible row left before the cutoff{window} (cleanup lag 0 s)"
        many = f"at least {LEFTOVER_CAP:,}" if self.capped else f"{self.count:,}"
        return (
            f"{many} eligible row(s) left before the cutoff {cutoff:%Y-%m-%d %H:%M:%S}Z{window}, the oldest"
            f" from {self.oldest}: cleanup lag {self.lag_seconds:,.0f} s"
        )


def measure_leftovers(
    conn: Any,
    policy: RetentionPolicy,
    cutoff: datetime,
    *,
    ledger: Ledger | None = None,
    run_key: str | None = None,
    target: TargetInfo | None = None,
    record: bool = True,
    windowed: bool = False,
    timeout_ms: int | None = None,
) -> Leftovers:
    """Find the oldest eligible row before ``cutoff`` and count those left (up to :data:`LEFTOVER_CAP`);
    record them on the run's ledger row when ``ledger`` and ``run_key`` are given (and ``record``). With
    per-tenant rules, each tenant is measured against the run's frozen cutoff of that tenant, and the
    rows of tenants held back by ``max_rows_per_tenant`` count as left (deferred). Rows reopened or
    inserted with old timestamps after planning show up here, as do chunks that left rows behind.

    :param windowed: walk only from the start of the lag window (``Ledger.lag_window_start``): every
        older row was eligible when the policy's previous measured run was measured, so it was deleted
        or counted then. Only a row that became eligible since with a timestamp older than that
        window is not seen (the next run deletes it like any other).
    :param timeout_ms: a ``statement_timeout`` for the walk below the policy's own.
    """
    cutoff = as_utc(cutoff)
    dbapi.prepare(conn)
    target = target or inspect_target(conn, policy)
    # Per-tenant cutoffs as the run froze them; tenants at their cap count as left (deferred).
    cutoffs = tenants.frozen(conn, ledger, policy, run_key, cutoff) if ledger and run_key else TenantCutoffs(cutoff)
    since = None
    if windowed and ledger is not None and run_key is not None:
        since = ledger.lag_window_start(conn, policy.name, policy.dry_run, run_key, cutoff)
    params = {**cutoffs.params(), "lo": MIN_KEY, "hi": MAX_KEY, "cap": LEFTOVER_CAP, "since": since}
    with dbapi.transaction(conn) as cur:
        statement_ms = min(policy.statement_timeout_ms, timeout_ms) if timeout_ms else policy.statement_timeout_ms
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, statement_ms)
        cur.execute(leftover_statement(policy, target, since=since is not None), params)
        oldest, count = cur.fetchone()
    lag = 0.0
    if oldest is not None:
        aware = oldest if oldest.tzinfo else oldest.replace(tzinfo=timezone.utc)
        lag = max(0.0, (cutoff - aware).total_seconds())
    leftovers = Leftovers(oldest=oldest, count=int(count), lag_seconds=lag, since=since)
    if record and ledger is not None and run_key is not None:
        ledger.record_cleanup_lag(conn, run_key, oldest=oldest, left=leftovers.count, lag_seconds=lag)
    return leftovers


def lag_left_to_next_run(run: Mapping[str, Any]) -> str | None:
    """Why a run's verify leaves its cleanup lag to the next run's planning (None: measure it now).

    Right after a purge the timestamp index still holds an entry for every row just deleted, until
    VACUUM removes them, and the first walk visits the heap for each (0.5 us a row here: 2.9 s after
    5.6M rows, which took the DELETE 4.7 s). At the next run's planning autovacuum has usually removed
    them, and the walk costs what the rows in its window cost.
    """
    deleted = int(run.get("rows_deleted") or 0)
    if deleted <= LAG_AT_VERIFY_ROWS:
        return None
    return (
        f"this run deleted {deleted:,} rows and the timestamp index keeps an entry for each until VACUUM;"
        " walking them now would add about half a microsecond a row to the run, so the next run measures"
        " it when it plans, before deleting anything"
    )


def measure_pending_lag(conn: Any, policy: RetentionPolicy, ledger: Ledger) -> tuple[dict[str, Any], Leftovers] | None:
    """At a run's planning, before its chunks delete anything: measure and record the cleanup lag of the
    policy's latest complete run when that run's verify left it (:func:`lag_left_to_next_run`), over the
    lag window. Returns the run's ledger row and what is left, or None when nothing was pending."""
    version = ledger.version(conn)
    if version is None or version < 4:  # tenant_cutoffs, read for the window, came with version 4
        return None
    run = ledger.lag_pending(conn, policy.name, policy.dry_run)
    if run is None:
        return None
    leftovers = measure_leftovers(conn, policy, run["cutoff"], ledger=ledger, run_key=run["run_key"], windowed=True)
    return run, leftovers


def vacuum_table(conn: Any, policy: RetentionPolicy) -> None:
    """``VACUUM (ANALYZE)`` the policy's table: outside any transaction, so in autocommit for its
    duration. Needs the table's ownership (PostgreSQL 15); without it PostgreSQL only warns."""
    dbapi.outside_transaction(conn, f"VACUUM (ANALYZE) {policy.table.sql}")


# Cron presets, as the scheduler reads them (the cleanup SLO's schedule interval reads them too).
CRON_PRESETS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@quarterly": "0 0 1 */3 *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}


def scheduled_anchors(schedule: str | None, start: datetime, end: datetime) -> list[datetime]:
    """The instants a cron schedule fires in ``[start, end]`` (UTC): the dates its runs stand for, since a
    cron-scheduled Airflow 3 run's logical date is its trigger time. Empty for schedules without a cron."""
    expression = CRON_PRESETS.get(schedule or "", schedule or "")
    if not expression or expression.startswith("@"):
        return []
    from croniter import croniter

    # croniter is given and returns naive UTC: aware inputs (pendulum's included) vary by version.
    begin = datetime.fromtimestamp(start.timestamp(), tz=timezone.utc).replace(tzinfo=None)
    stop = datetime.fromtimestamp(end.timestamp(), tz=timezone.utc).replace(tzinfo=None)
    it = croniter(expression, begin - timedelta(microseconds=1))
    anchors = []
    while (moment := it.get_next(datetime).replace(tzinfo=None)) <= stop:
        anchors.append(moment.replace(tzinfo=timezone.utc))
    return anchors


@dataclass(frozen=True)
class MissedRun:
    """A scheduled date without a complete run of its own. ``covered_by`` is the cutoff of a later complete
    run that already deleted everything this date's run would (its cutoff is at or past this one's): such a
    date needs no backfill. None: its run could still delete rows."""

    anchor: datetime
    cutoff: datetime
    run_key: str
    covered_by: datetime | None = None

    def describe(self, dag_id: str) -> str:
        day = self.anchor.strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            f"no complete run for {day} (cutoff {self.cutoff.strftime('%Y-%m-%dT%H:%M:%SZ')}): that run was"
            f" missed; backfill it: airflow backfill create --dag-id {dag_id} --from-date {day} --to-date {day}"
        )


@dataclass(frozen=True)
class MissedDays:
    """The scheduled dates in ``(since, until)`` without a complete run, split in two: ``missed``, whose run
    could still delete rows (a backfill is worth it), and ``covered``, whose cutoff a later complete run has
    already passed (their run would find nothing it may delete). One definition for the verify task's log,
    ``airflow-retention status`` and the Retention view."""

    since: datetime
    until: datetime
    missed: list[MissedRun] = field(default_factory=list)
    covered: list[MissedRun] = field(default_factory=list)

    @property
    def latest_cover(self) -> datetime | None:
        """The cutoff of the complete run that covers the covered dates (the latest complete run)."""
        return max((m.covered_by for m in self.covered if m.covered_by is not None), default=None)


def missed_runs(conn: Any, ledger: Ledger, policy: RetentionPolicy, start: datetime, end: datetime) -> list[MissedRun]:
    """The scheduled dates in ``[start, end]`` whose run is not complete in the ledger: the gaps that a
    paused DAG or a scheduler outage leaves, until a backfill fills them. Each says whether a later complete
    run covers it (:attr:`MissedRun.covered_by`): whichever run has the latest cutoff, whenever it completed."""
    from airflow_retention.core.planning.cutoff import freeze_cutoff, run_key

    expected = {freeze_cutoff(policy, anchor): anchor for anchor in scheduled_anchors(policy.schedule, start, end)}
    if not expected:
        return []
    done = ledger.complete_cutoffs(conn, policy.name, policy.dry_run, min(expected), max(expected))
    # A dry run deletes nothing, so it covers nothing; a policy in dry-run mode has only dry runs.
    latest = None if policy.dry_run else ledger.latest_complete_cutoff(conn, policy.name, False)
    return [
        MissedRun(
            anchor=anchor,
            cutoff=cutoff,
            run_key=run_key(policy, cutoff),
            covered_by=latest if latest is not None and latest >= cutoff else None,
        )
        for cutoff, anchor in sorted(expected.items())
        if cutoff not in done
    ]


def missed_days(conn: Any, ledger: Ledger, policy: RetentionPolicy, until: datetime) -> MissedDays:
    """The scheduled dates of the window before ``until`` (``until - MISSED_RUNS_WINDOW``, exclusive, to
    ``until``, exclusive; never before the policy's start date) without a complete run, split into those a
    backfill could still delete rows for and those a later run covered. The verify task passes its run's
    own date; the CLI and the view pass now minus :data:`MISSED_RUNS_GRACE`."""
    since = until - MISSED_RUNS_WINDOW
    start = max(policy.start_date, since + timedelta(microseconds=1))
    end = until - timedelta(microseconds=1)
    if end < start:
        return MissedDays(since, until)
    found = missed_runs(conn, ledger, policy, start, end)
    return MissedDays(
        since,
        until,
        missed=[m for m in found if m.covered_by is None],
        covered=[m for m in found if m.covered_by is not None],
    )
