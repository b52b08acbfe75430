"""How fast a chunk goes: the adaptive batch size, and the pressure checks that pause it.

Both run between batches, outside their transactions, and both are plain functions of what the engine
measured or what the database reports, so that they can be tested without a purge.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from airflow_retention.core import dbapi
from airflow_retention.core.errors import RetryableError
from airflow_retention.core.policy import RetentionPolicy, Throttle

log = logging.getLogger(__name__)

# Hysteresis: shrink at once above the band, grow only after CALM_BATCHES batches below it; far below
# it (a first batch of 5,000 rows that took 10 ms) there is nothing to oscillate around: grow at once.
SHRINK_ABOVE = 1.25
GROW_BELOW = 0.75
FAR_BELOW = 0.25
CALM_BATCHES = 2
MAX_STEP = 2.0
MAX_BACKOFF_MS = 60_000


class BatchSizer:
    """Steers the batch size towards ``target_ms`` per batch transaction.

    A slow batch shrinks the next one at once (by at most half); fast batches grow it (by at most
    double) only after :data:`CALM_BATCHES` in a row, so the size settles instead of oscillating, except
    that a batch under a quarter of the target doubles the size at once. A batch that ended its range
    early (fewer keys than asked) says nothing about the size and is ignored.
    With ``target_ms`` 0 the size never changes.
    """

    def __init__(self, start: int, smallest: int, largest: int, target_ms: int) -> None:
        self.size = max(smallest, min(largest, start))
        self.smallest = smallest
        self.largest = largest
        self.target_ms = target_ms
        self._calm = 0

    @classmethod
    def for_policy(cls, policy: RetentionPolicy, start: int | None = None) -> BatchSizer:
        return cls(start or policy.batch_size, policy.min_batch_size, policy.max_batch_size, policy.target_batch_ms)

    def observe(self, ms: float, *, full: bool) -> int:
        """Record a committed batch's duration; return the next batch's size."""
        if not self.target_ms or not full or ms <= 0:
            return self.size
        ratio = self.target_ms / ms
        if ms > self.target_ms * SHRINK_ABOVE:
            self._calm = 0
            self.size = max(self.smallest, int(self.size * max(ratio, 1 / MAX_STEP)))
        elif ms < self.target_ms * GROW_BELOW:
            self._calm += 1
            if self._calm >= CALM_BATCHES or ms < self.target_ms * FAR_BELOW:
                self._calm = 0
                self.size = min(self.largest, int(self.size * min(ratio, MAX_STEP)))
        else:
            self._calm = 0
        return self.size


# Without pg_monitor (pg_read_all_stats) a role sees the standbys' rows with NULL state and lag.
_REPLICA_LAG_MS = (
    "SELECT coalesce(max(extract(epoch FROM replay_lag)) * 1000, 0)::double precision,"
    " count(*) - count(state) FROM pg_stat_replication"
)
_LOCK_WAITERS = "SELECT count(*) FROM pg_catalog.pg_locks WHERE relation = %(t)s::regclass AND NOT granted"


@dataclass(frozen=True)
class Reading:
    """One look at the database's pressure signals; ``reasons`` is empty when all are below threshold."""

    reasons: tuple[str, ...]

    @property
    def calm(self) -> bool:
        return not self.reasons


def read_pressure(conn: Any, policy: RetentionPolicy) -> Reading:
    """Compare each configured signal with its threshold (one short read-only transaction)."""
    t = policy.throttle
    reasons: list[str] = []
    with dbapi.transaction(conn) as cur:
        dbapi.set_local_timeouts(cur, policy.lock_timeout_ms, policy.statement_timeout_ms)
        if t.max_replica_lag_ms is not None:
            cur.execute(_REPLICA_LAG_MS)
            lag_ms, hidden = cur.fetchone()
            lag = float(lag_ms or 0)
            if hidden:
                log.warning(
                    "policy %s: %d standby(s) whose replay lag this role cannot see; grant it pg_monitor, or"
                    " max_replica_lag is never exceeded",
                    policy.name,
                    hidden,
                )
            if lag > t.max_replica_lag_ms:
                reasons.append(f"replica replay lag {lag / 1000:.1f} s > {t.max_replica_lag_ms / 1000:g} s")
        if t.max_lock_waiters is not None:
            cur.execute(_LOCK_WAITERS, {"t": policy.table.regclass_literal})
            waiters = int(cur.fetchone()[0])
            if waiters > t.max_lock_waiters:
                reasons.append(f"{waiters} lock request(s) waiting on {policy.table} > {t.max_lock_waiters}")
        if t.probe is not None:
            assert t.probe_max is not None
            cur.execute(t.probe)
            row = cur.fetchone()
            value = float(row[0]) if row and row[0] is not None else 0.0
            if value > t.probe_max:
                reasons.append(f"pressure probe returned {value:g} > {t.probe_max:g}")
    return Reading(tuple(reasons))


@dataclass
class Throttler:
    """Pauses a chunk while the database is under pressure: sleeps with jitter, doubling from
    ``backoff`` up to a minute, and stops the chunk as retryable once it has paused ``give_up_after``
    in this attempt. ``sleep`` and ``rng`` are injectable for tests.

    ``pending`` holds the pauses not yet written to the ledger; :meth:`take` hands them to the next
    batch's ledger update (or to the error record when the chunk gives up).
    """

    policy: RetentionPolicy
    label: str
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    paused_s: float = 0.0
    pending: tuple[int, float] = (0, 0.0)

    def take(self) -> tuple[int, float]:
        pending, self.pending = self.pending, (0, 0.0)
        return pending

    def wait_until_calm(self, conn: Any) -> None:
        """Return once every signal is below its threshold; raise :class:`RetryableError` past the ceiling."""
        settings: Throttle = self.policy.throttle
        if not settings.enabled:
            return
        step_ms = settings.backoff_ms
        paused_here = 0
        while True:
            reading = read_pressure(conn, self.policy)
            if reading.calm:
                if paused_here:
                    log.info("%s: pressure eased after %d pause(s); resuming", self.label, paused_here)
                return
            why = "; ".join(reading.reasons)
            if self.paused_s * 1000 >= settings.give_up_after_ms:
                raise RetryableError(
                    f"{self.label}: database still under pressure after pausing {self.paused_s:.1f} s in this"
                    f" attempt (give_up_after {settings.give_up_after_ms / 1000:g} s): {why}. Committed batches"
                    " stay; the task's retry resumes the chunk"
                )
            # Jitter in [step/2, step]: paused workers of one run do not wake in lockstep.
            pause = self.rng.uniform(step_ms / 2, step_ms) / 1000
            log.warning("%s: backing off %.2f s: %s", self.label, pause, why)
            self.sleep(pause)
            paused_here += 1
            self.paused_s += pause
            self.pending = (self.pending[0] + 1, self.pending[1] + pause)
            step_ms = min(step_ms * 2, MAX_BACKOFF_MS)
