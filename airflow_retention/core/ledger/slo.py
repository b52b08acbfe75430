"""What the ledger's history tells about a policy's cleanup SLO (:mod:`airflow_retention.core.running.slo`):
its recent complete runs (rows per run, the backlog each left), the time its chunks spent working, the
pauses per reason of a run (``chunks.paused``), the budget's share of the database over a run's span
(``budget_observations``), and the budget's shared state as it stands (``budget_state``), read only:
``status`` and the view read a ledger without writing to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.budget import SCOPE
from airflow_retention.core.ledger.history import CHUNK_ROWS, WORKED_SECONDS
from airflow_retention.core.ledger.schema import LedgerSchema

# The version that added the budget's tables and ``chunks.paused``.
BUDGET_VERSION = 8


def at_floor_sql(alias: str = "") -> str:
    """An observation of the budget (``alias``: its table's, with the dot) at a policy's floor: paused, or at
    a level no higher than ``%(floor_level)s``, the policy's (``controller.floor_level``)."""
    return f"({alias}paused OR {alias}level <= %(floor_level)s::integer)"


@dataclass(frozen=True)
class RunSample:
    """One complete run of the sample: its rows and what it left."""

    run_key: str
    cutoff: datetime
    run_date: datetime | None
    completed_at: datetime | None
    rows: int
    eligible_left: int | None


@dataclass(frozen=True)
class BudgetShare:
    """The budget over a span: how many observations, how many at the floor (level 0) or paused, the
    time-weighted mean of ``concurrency x duty`` (0 while paused; None without observations), and the
    signals named by the reasons of the floor's observations, most frequent first."""

    observations: int
    at_floor: int
    mean_share: float | None
    floor_reasons: tuple[str, ...]


class LedgerSlo(LedgerSchema):
    """The history behind a policy's cleanup SLO, and the budget's state, read only."""

    def slo_runs(self, conn: Any, policy: str, *, dry_run: bool, limit: int) -> list[RunSample]:
        """The policy's latest ``limit`` complete planned runs of this mode, latest cutoff first."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT run_key, cutoff, (to_jsonb(r) ->> 'run_date')::timestamptz, completed_at,"
            " coalesce(rows_deleted, 0) + coalesce(rows_matched, 0), eligible_left"
            f" FROM {self.s}.runs r WHERE policy = %(p)s::text AND dry_run = %(d)s::boolean AND state = 'complete'"
            " AND run_key NOT LIKE '%%#lone' ORDER BY cutoff DESC, completed_at DESC LIMIT %(n)s::integer",
            {"p": policy, "d": dry_run, "n": limit},
        )
        return [RunSample(k, c, d, done, int(n), left) for k, c, d, done, n, left in rows]

    def work_of(self, conn: Any, run_keys: Sequence[str]) -> tuple[int, float]:
        """Rows and seconds worked by the complete row chunks of ``run_keys`` done in one attempt (a retried
        chunk's span holds the retry's delay; a partition chunk's rows are not a batch's)."""
        if not run_keys:
            return 0, 0.0
        # Rows and seconds as the planner's measured rate counts them.
        rows = dbapi.fetch_all(
            conn,
            f"SELECT coalesce(sum({CHUNK_ROWS}), 0), coalesce(sum({WORKED_SECONDS}), 0)"
            f" FROM {self.s}.chunks c WHERE c.run_key = ANY (%(keys)s::text[]) AND c.state = 'complete'"
            " AND c.action IS NULL AND c.attempts = 1 AND c.first_started_at IS NOT NULL",
            {"keys": list(run_keys)},
        )
        return int(rows[0][0]), float(rows[0][1])

    def last_worked_run(self, conn: Any, policy: str, *, dry_run: bool) -> tuple[str, datetime, datetime] | None:
        """The policy's complete planned run (of this mode) completed last among those whose chunks ran a
        batch, with the span of its batches (the first chunk's first batch to the last chunk's last)."""
        rows = dbapi.fetch_all(
            conn,
            "SELECT r.run_key, min(c.first_started_at), max(coalesce(c.completed_at, c.last_batch_at))"
            f" FROM {self.s}.runs r JOIN {self.s}.chunks c USING (run_key)"
            " WHERE r.policy = %(p)s::text AND r.dry_run = %(d)s::boolean AND r.state = 'complete'"
            " AND r.run_key NOT LIKE '%%#lone' AND c.first_started_at IS NOT NULL"
            " GROUP BY r.run_key, r.completed_at ORDER BY r.completed_at DESC NULLS LAST LIMIT 1",
            {"p": policy, "d": dry_run},
        )
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else None

    def paused_by_reason(self, conn: Any, run_key: str) -> dict[str, float]:
        """Seconds the chunks of ``run_key`` paused for the budget, by reason, most first (empty on a ledger
        older than version 8)."""
        return self.paused_by_run(conn, [run_key]).get(run_key, {})

    def paused_by_run(self, conn: Any, run_keys: Sequence[str]) -> dict[str, dict[str, float]]:
        """:meth:`paused_by_reason` of several runs in one statement, by run key (a run that never paused
        is left out)."""
        if not run_keys or not self._has_budget(conn):
            return {}
        rows = dbapi.fetch_all(
            conn,
            "SELECT c.run_key, d.key, sum(d.value::float8) FROM"
            f" {self.s}.chunks c, jsonb_each_text(c.paused) d WHERE c.run_key = ANY (%(keys)s::text[])"
            " GROUP BY c.run_key, d.key ORDER BY 1, 3 DESC, 2",
            {"keys": list(run_keys)},
        )
        out: dict[str, dict[str, float]] = {}
        for key, reason, seconds in rows:
            out.setdefault(key, {})[reason] = round(float(seconds), 3)
        return out

    def budget_share(
        self, conn: Any, since: datetime, until: datetime, *, floor_level: int, max_duty: float = 1.0
    ) -> BudgetShare:
        """The budget's observations from ``since`` to ``until``, with the one in force at ``since``: each
        holds until the next one (the last until ``until``), so the mean of ``concurrency x duty`` (the duty
        no higher than ``max_duty``, the policy's own) is weighted by how long each held. At the floor: paused,
        or at ``floor_level`` (the policy's) or below."""
        if not self._has_budget(conn):
            return BudgetShare(0, 0, None, ())
        params = {"scope": SCOPE, "since": since, "until": until, "max_duty": max_duty, "floor_level": floor_level}
        at_floor = at_floor_sql()
        observed = f"SELECT at, level, concurrency, duty, paused, reasons FROM {self.s}.budget_observations"
        # The observation in force when the span began (the budget is observed before a run's first batch)
        # counts from the span's start; each held until the next one, the last until the span's end.
        held = (
            f"WITH b AS (({observed} WHERE scope = %(scope)s::text AND at <= %(since)s::timestamptz"
            " ORDER BY at DESC LIMIT 1)"
            f" UNION ALL {observed} WHERE scope = %(scope)s::text AND at > %(since)s::timestamptz"
            " AND at <= %(until)s::timestamptz),"
            " o AS (SELECT level, paused, reasons,"
            " CASE WHEN paused THEN 0 ELSE concurrency * least(duty, %(max_duty)s::float8) END AS share,"
            " extract(epoch FROM coalesce(lead(at) OVER (ORDER BY at), %(until)s::timestamptz)"
            " - greatest(at, %(since)s::timestamptz)) AS held FROM b)"
        )
        count, floor, weighted, plain = dbapi.fetch_all(
            conn,
            f"{held} SELECT count(*), count(*) FILTER (WHERE {at_floor}),"
            " sum(share * held) / nullif(sum(held), 0), avg(share) FROM o",
            params,
        )[0]
        reasons = dbapi.fetch_all(
            conn,
            f"{held} SELECT split_part(r, ' ', 1), count(*) FROM o, unnest(o.reasons) r"
            f" WHERE {at_floor} GROUP BY 1 ORDER BY 2 DESC, 1",
            params,
        )
        mean = weighted if weighted is not None else plain
        return BudgetShare(
            int(count), int(floor), float(mean) if mean is not None else None, tuple(r for r, _ in reasons)
        )

    def budget_snapshot(self, conn: Any) -> dict[str, Any] | None:
        """The budget's shared state as the last observation left it (None: never observed, or a ledger
        older than version 8), with ``age_s``, the seconds since that observation."""
        if not self._has_budget(conn):
            return None
        fields = ("level", "quiet", "paused", "concurrency", "duty", "baseline_ms", "canary_ms", "reasons",
                  "causes", "signals", "observed_at", "observer", "age_s")  # fmt: skip
        rows = dbapi.fetch_all(
            conn,
            "SELECT level, quiet, paused, concurrency, duty, baseline_ms, canary_ms, reasons, causes, signals,"
            " observed_at, observer, extract(epoch FROM clock_timestamp() - observed_at)::float8"
            f" FROM {self.s}.budget_state WHERE scope = %(scope)s::text AND observed_at IS NOT NULL",
            {"scope": SCOPE},
        )
        if not rows:
            return None
        state = dict(zip(fields, rows[0], strict=True))
        state["reasons"], state["causes"] = list(state["reasons"]), list(state["causes"])
        return state

    def _has_budget(self, conn: Any) -> bool:
        version = self.version(conn)
        return version is not None and version >= BUDGET_VERSION
