"""A ledger with real runs for the Retention view's tests, written by the core engine, and a reader of the
view's HTML.

Four daily runs of one policy, anchored on ``anchors[0..3]``: the first, third and fourth complete and
verified, the second planned, one chunk purged, one chunk with an error, its cleanup lag measured midway;
the fifth anchor's run is never planned. So the view has complete and running runs, a non-zero cleanup
lag, a chunk error, and two missed days (the second anchor's and the fifth's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from html.parser import HTMLParser
from typing import Any

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers
from tests.core.helpers import FLOOR_DUTY, FLOOR_LEVEL, create_events, fill_events, policy_data

CHUNK_ERROR = "lock timeout (SQLSTATE 55P03): canceling statement due to lock timeout"
# Rows from two days before the first cutoff to the fourth cutoff, one an hour of 120, spread evenly.
CREATED = "%(cutoff)s::timestamptz + (mod(g * 37, 120) - 48) * interval '1 hour'"


# The pause reason and the signal the seeded budget is paused for (rows written directly: the engine would
# need a standby for it).
PAUSE_CAUSE = "replica_lag"
PAUSE_REASON = "replica_lag 45000ms > 30000ms"


def view_policy_data(schema: str, conn_id: str, start: datetime, name: str = "events_purge") -> dict[str, Any]:
    """A daily policy on ``schema.events`` (chunks of 100 rows) starting at ``start``; its budget observes
    every 100 ms and its own duty cycle is half, so that the engine's runs leave observations and pauses
    (``max_duty_cycle``) in the ledger. The WAL rate is recorded, not obeyed: beside the rest of the suite
    the server's WAL passes its limit, and the runs' rests would go to ``wal_rate`` some of the time."""
    return policy_data(
        schema,
        name=name,
        conn_id=conn_id,
        chunk_rows=100,
        batch_size=100,
        start_date=start.isoformat(),
        max_duty_cycle=0.5,
        budget={"period": "100ms", "max_wal_rate": False},
    )


@dataclass(frozen=True)
class Seeded:
    policy: RetentionPolicy
    anchors: list[datetime]
    complete: list[str]  # run keys
    partial: str
    failing_chunk: str


def seed_runs(admin: Any, conn: Any, schema: str, policy: RetentionPolicy, first_anchor: datetime) -> Seeded:
    """Create and fill ``schema.events``, then write the four runs. ``admin``: autocommit; ``conn``: psycopg2."""
    anchors = [first_anchor + timedelta(days=d) for d in range(5)]
    cutoffs = [freeze_cutoff(policy, a) for a in anchors]
    table = create_events(admin, schema)
    fill_events(admin, table, 3000, cutoff=cutoffs[0], created=CREATED)
    ledger = Ledger(policy.ledger_schema)
    complete, partial, failing = [], "", ""
    for day in (0, 1, 2, 3):
        plan = plan_run(conn, policy, cutoffs[day], planned_by="test")
        assert len(plan.chunks) >= 3, f"the seed wants several chunks a run, got {len(plan.chunks)}"
        if day == 1:
            run_chunk(conn, policy, cutoffs[day], plan.chunks[0])
            failing = plan.chunks[1].key
            ledger.record_error(conn, plan.run_key, failing, CHUNK_ERROR, 1000)
            measure_leftovers(conn, policy, cutoffs[day], ledger=ledger, run_key=plan.run_key)
            partial = plan.run_key
            continue
        for chunk in plan.chunks:
            run_chunk(conn, policy, cutoffs[day], chunk)
        ledger.complete_run(conn, plan.run_key, "test")
        measure_leftovers(conn, policy, cutoffs[day], ledger=ledger, run_key=plan.run_key)
        complete.append(plan.run_key)
    return Seeded(policy, anchors, complete, partial, failing)


def seed_budget_pressure(admin: Any, ledger_schema: str, held_run: str, floor_run: str | None = None) -> None:
    """What the engine cannot produce in a test's seconds: the budget paused now for :data:`PAUSE_REASON`,
    with five paused observations between ``held_run``'s last batch and now (so it is throttled, not
    stuck); and with
    ``floor_run``, observations at the ladder's floor over most of that run's span (an exhausted budget)."""
    s = f'"{ledger_schema}"'
    signals = '{"replica_lag": {"value": 45000, "limit": 30000, "effect": "pause", "error": null}}'
    with admin.cursor() as cur:
        cur.execute(
            f"UPDATE {s}.budget_state SET paused = true, reasons = %(r)s, causes = %(c)s, signals = %(sig)s::jsonb,"
            " observed_at = clock_timestamp() WHERE scope = 'database'",
            {"r": [PAUSE_REASON], "c": [PAUSE_CAUSE], "sig": signals},
        )
        assert cur.rowcount == 1, "the engine's runs should have created the budget's state"
        cur.execute(
            f"INSERT INTO {s}.budget_observations (at, scope, level, concurrency, duty, paused, move, canary_ms,"
            " baseline_ms, slots_busy, signals, reasons, observer)"
            " SELECT b.since + (clock_timestamp() - b.since) * g / 6.0, 'database', 5, 1,"
            " 1.0, true, 'pause', 9.0, 3.0, 0, %(sig)s::jsonb, %(r)s, 'seed'"
            f" FROM (SELECT greatest(max(c.last_batch_at), r.planned_at) AS since FROM {s}.runs r"
            f" JOIN {s}.chunks c USING (run_key) WHERE r.run_key = %(k)s GROUP BY r.planned_at) b,"
            " generate_series(1, 5) g",
            {"sig": signals, "r": [PAUSE_REASON], "k": held_run},
        )
        assert cur.rowcount == 5
        if floor_run is not None:
            # Twenty observations at the default floor over the run's span: more than the engine's.
            cur.execute(
                f"INSERT INTO {s}.budget_observations (at, scope, level, concurrency, duty, paused, move, canary_ms,"
                " baseline_ms, slots_busy, signals, reasons, observer)"
                " SELECT r.planned_at + (r.completed_at - r.planned_at) * g / 21.0, 'database', %(l)s, 1, %(d)s, false,"
                " 'down', 12.0, 3.0, 1, '{}'::jsonb, ARRAY['canary_latency 12.0 ms > 6.0 ms (baseline 3.0 ms)'],"
                f" 'seed' FROM {s}.runs r, generate_series(1, 20) g WHERE r.run_key = %(k)s",
                {"k": floor_run, "l": FLOOR_LEVEL, "d": FLOOR_DUTY},
            )
            assert cur.rowcount == 20


def ledger_pauses(admin: Any, ledger_schema: str) -> dict[str, dict[str, float]]:
    """Seconds paused per reason of each run, summed here in Python from the chunks' raw ``paused``."""
    with admin.cursor() as cur:
        cur.execute(f'SELECT run_key, paused FROM "{ledger_schema}".chunks')
        out: dict[str, dict[str, float]] = {}
        for key, paused in cur.fetchall():
            for reason, seconds in paused.items():
                run = out.setdefault(key, {})
                run[reason] = run.get(reason, 0.0) + float(seconds)
        return out


def ledger_runs(admin: Any, schema: str) -> dict[str, dict[str, Any]]:
    """What the ledger holds per run, read with SQL of the test's own: totals summed from the chunks."""
    with admin.cursor() as cur:
        cur.execute(
            f"SELECT r.run_key, r.cutoff, r.state, r.chunks_expected, r.cleanup_lag_seconds,"
            f" count(*) FILTER (WHERE c.state = 'complete'), coalesce(sum(c.rows_deleted), 0)"
            f' FROM "{schema}".runs r LEFT JOIN "{schema}".chunks c USING (run_key)'
            " GROUP BY r.run_key ORDER BY r.cutoff"
        )
        return {
            key: {
                "cutoff": cutoff,
                "state": state,
                "chunks": f"{done}/{expected}",
                "cleanup_lag": lag,
                "rows_deleted": int(deleted),
            }
            for key, cutoff, state, expected, lag, done, deleted in cur.fetchall()
        }


def ledger_chunks(admin: Any, schema: str, run_key: str) -> dict[str, dict[str, Any]]:
    with admin.cursor() as cur:
        cur.execute(
            f'SELECT chunk_key, state, rows_deleted, attempts, last_error FROM "{schema}".chunks WHERE run_key = %(k)s',
            {"k": run_key},
        )
        return {
            key: {"state": state, "rows_deleted": int(rows), "attempts": int(attempts), "last_error": error}
            for key, state, rows, attempts, error in cur.fetchall()
        }


class ViewReader(HTMLParser):
    """The view's tables as the user sees them: per ``<tr data-run-key|data-chunk-key>``, each ``data-field``
    cell's ``data-value`` (or its text); the chart's bars; alerts; the backfill command."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.bars: dict[str, int] = {}
        self.lag_points: dict[str, float] = {}
        self.alerts: list[str] = []
        self.texts: dict[str, list[str]] = {}
        self._row: str | None = None
        self._field: str | None = None
        self._text: list[str] = []
        self._alert = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and ("data-run-key" in a or "data-chunk-key" in a):
            self._row = a.get("data-run-key") or a["data-chunk-key"]
            self.rows[self._row] = {}
        elif tag == "rect" and "data-rows" in a:
            self.bars[a["data-run-key"]] = int(a["data-rows"])
        elif tag == "circle" and "data-lag" in a:
            self.lag_points[a["data-run-key"]] = float(a["data-lag"])
        elif "data-field" in a and self._field is None:
            self._field = a["data-field"]
            self._text = []
            if self._row is not None and "data-value" in a:
                self.rows[self._row][self._field] = a["data-value"]
        if a.get("role") == "alert":
            self._alert = True
            self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        text = " ".join("".join(self._text).split())
        if tag in ("td", "pre", "p", "dd", "li") and self._field is not None:
            if self._row is not None and tag == "td":
                self.rows[self._row].setdefault(self._field, text)
            else:
                self.texts.setdefault(self._field, []).append(text)
            self._field = None
        if tag == "p" and self._alert:
            self.alerts.append(text)
            self._alert = False
        if tag == "tr":
            self._row = None


def shown_policies(html: str) -> set[str]:
    """The policies a page shows a section of."""
    return set(re.findall(r'<section [^>]*data-policy="([^"]+)"', html))


def shown_problems(html: str) -> set[str]:
    """The DAG ids of the policies-file problems a page shows."""
    return set(re.findall(r'data-kind="policy_error" data-dag-id="([^"]+)"', html))


def connection_details(dsn: str) -> list[str]:
    """What a page must not show of the connection ``dsn`` to a user who may not read it: its host, port, user
    and database, as the driver and ``redact`` write them."""
    from psycopg2.extensions import parse_dsn

    parts = parse_dsn(dsn)
    port = parts.get("port", "5432")
    details = [parts.get("host", "/var/run/postgresql"), f"port {port}", f"port={port}"]
    for key in ("user", "dbname"):
        if key in parts:  # as the driver quotes it, and as the DSN writes it
            details += [f'"{parts[key]}"', f"{key}={parts[key]}"]
    return details
