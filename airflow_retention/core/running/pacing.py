"""How fast a chunk goes: the adaptive batch size, the checkpoint watch and the statement cap that keep
batches short, the duty cycle, and the pressure checks that pause a chunk.

All run between batches, outside their transactions, and all are plain functions of what the engine
measured or what the database reports, so that they can be tested without a purge.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.errors import PermanentError, RetryableError
from airflow_retention.core.policy.model import RetentionPolicy, Throttle

log = logging.getLogger(__name__)

# Hysteresis: shrink at once above the band, grow only after CALM_BATCHES batches below it; far below
# it (a first batch of 5,000 rows that took 10 ms) there is nothing to oscillate around: grow at once.
# A slow batch shrinks the next one by its whole ratio: after a checkpoint the same rows cost 3-7 times
# as much (full-page writes), and halving per batch let three batches in a row run long.
SHRINK_ABOVE = 1.25
GROW_BELOW = 0.75
FAR_BELOW = 0.25
CALM_BATCHES = 2
MAX_STEP = 2.0
MAX_BACKOFF_MS = 60_000


# The statement cap: a batch statement still running at 1.5x the target is cancelled (its transaction
# rolls back) and its range retried a quarter as big, which leaves room for the ledger update and the
# commit within 2x the target.
STATEMENT_CAP = 1.5
CUT_SHORT_DIVISOR = 4
# After a one-pass batch fails on a row someone else changed (40001), it is taken again after a pause
# doubling from CONFLICT_BACKOFF_BASE_S up to CONFLICT_BACKOFF_CAP_S: a writer that keeps changing rows
# gets time to commit, and 20 retries span seconds rather than milliseconds.
CONFLICT_BACKOFF_BASE_S = 0.01
CONFLICT_BACKOFF_CAP_S = 1.0
# Full-page writes: a batch that may run into a checkpoint's start is cut to a quarter. The first change
# to a page after a checkpoint writes the whole 8 kB page to the WAL; measured on block chunks at 10M
# rows, batches aiming at 200 ms took 637 and 1,430 ms there. The cap catches what a quarter misses.
FULL_PAGE_SHRINK = 4
# At a low duty cycle batches aim shorter, so that the rest after each is at most one budget period: the
# same share of the time in smaller pieces. At 1 % a 300 ms batch wrote ~25 MB of WAL in one burst, then
# rested 30 s, and the foreground's commits that met the burst waited behind it (docs/performance.md).
SHORTEST_AIM_MS = 10
# Below a duty cycle of 1 a batch's WAL is capped too: the application's commits that arrive during a batch
# wait for its WAL to reach the disk before theirs, whatever the batch's duration. Beside pgbench at 300
# tps and the same 5,000 rows a second, batches of up to 4,000 rows (about 1.3 MB of WAL) left its p99
# within 1.2x of its p99 alone, batches of 16,000 rows (5 MB) at 2.4x (docs/performance.md, "The burst
# of WAL"). 256 kB rather than 1 MB: in four A/B runs beside pgbench (1 and 4 workers, both orders) its
# p99 was lower by 0.10-0.23 of its p99 alone, for 5-30 % more time beside it; on an idle database (duty 1)
# there is no cap (docs/performance.md, "A smaller WAL burst, the default").
BURST_WAL_BYTES = 1 << 18


class BatchSizer:
    """Steers the batch size towards ``target_ms`` per batch transaction.

    A slow batch shrinks the next one at once, to the size its observed rate fits in the target; fast
    batches grow it (by at most double) only after :data:`CALM_BATCHES` in a row, so the size settles
    instead of oscillating, except that a batch under a quarter of the target doubles the size at once.
    A batch that ended its range early (fewer keys than asked) says nothing about the size and is
    ignored. With ``target_ms`` 0 the size never changes.

    After the statement cap cut a batch, the size never grows past half of it again in this chunk: in a
    block chunk's tail of cold pages that hold no eligible rows, batches that delete nothing are fast and
    doubled at once, and the next big one reads cold pages past the cap again (a chunk was cut five times
    in 7 s at the same 172,624 rows: 300 ms of reading thrown away each time).
    """

    def __init__(self, start: int, smallest: int, largest: int, target_ms: int) -> None:
        self.size = max(smallest, min(largest, start))
        self.smallest = smallest
        self.largest = largest
        self.target_ms = target_ms
        self._calm = 0
        self._ceiling = largest  # lowered by each cut: see the class docstring

    @classmethod
    def for_policy(cls, policy: RetentionPolicy, start: int | None = None) -> BatchSizer:
        return cls(start or policy.batch_size, policy.min_batch_size, policy.max_batch_size, policy.target_batch_ms)

    def observe(self, ms: float, *, full: bool, size: int | None = None) -> int:
        """Record a committed batch's duration; return the next batch's size.

        :param size: the batch's size when it was not :attr:`size` (the checkpoint watch shrank it).
        """
        if not self.target_ms or not full or ms <= 0:
            return self.size
        used = size or self.size
        ratio = self.target_ms / ms
        if ms > self.target_ms * SHRINK_ABOVE:
            self._calm = 0
            self.size = max(self.smallest, min(self.size, int(used * ratio)))
        elif ms < self.target_ms * GROW_BELOW:
            self._calm += 1
            if self._calm >= CALM_BATCHES or ms < self.target_ms * FAR_BELOW:
                self._calm = 0
                self.size = min(self._ceiling, max(self.size, int(used * min(ratio, MAX_STEP))))
        else:
            self._calm = 0
        return self.size

    def cut_short(self, size: int) -> bool:
        """A batch of ``size`` hit the statement cap and rolled back: retry a quarter of it. False when
        it was the smallest already (then it was not capped, and the timeout is the policy's own)."""
        if size <= self.smallest:
            return False
        self._calm = 0
        self.size = max(self.smallest, size // CUT_SHORT_DIVISOR)
        self._ceiling = max(self.size, min(self._ceiling, size // 2))
        return True


# WAL since the last completed checkpoint's redo point, the position now, and that checkpoint's age.
# pg_control_checkpoint() is executable by every role by default; a role it was revoked from degrades.
_LSN_BYTES = "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::double precision"
_CHECKPOINT_POSITION = (
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), redo_lsn)::double precision,"
    f" {_LSN_BYTES},"
    " extract(epoch FROM now() - checkpoint_time)::double precision FROM pg_control_checkpoint()"
)
_WAL_POSITION = f"SELECT {_LSN_BYTES}"
_CHECKPOINT_SETTINGS = (
    "SELECT pg_size_bytes(current_setting('max_wal_size'))::double precision,"
    " current_setting('checkpoint_completion_target')::double precision,"
    " pg_size_bytes(current_setting('wal_segment_size'))::double precision,"
    " (SELECT setting::double precision FROM pg_catalog.pg_settings WHERE name = 'checkpoint_timeout')"
)


@dataclass
class CheckpointWatch:
    """Foresees the start of a checkpoint, after which every page a batch changes first writes a
    full-page image to the WAL, so that the batches around it are cut to 1/:data:`FULL_PAGE_SHRINK`
    until the batch size has been measured with the full-page writes.

    A checkpoint starts when the WAL since the last one's redo point passes about ``max_wal_size /
    (1 + checkpoint_completion_target)``, or ``checkpoint_timeout`` after the last one. Before each batch
    the watch reads the WAL position and the last checkpoint (one short read-only transaction), and
    estimates the next batch's WAL from the last batch's. While the next batch could cross the trigger
    the batch is cut; once the WAL is past it (a checkpoint is running) one more cut batch measures the
    new cost, and then batches go back to the adaptive size, until the next checkpoint. Without the privilege to read
    ``pg_control_checkpoint()`` the watch switches itself off (once, with a warning) and the statement
    cap alone bounds the batches.
    """

    label: str
    enabled: bool = True
    trigger_bytes: float = 0.0
    timeout_s: float = 0.0
    _lsn: float | None = None
    _wal_per_row: float | None = None
    _last_size: int | None = None
    _measured_redo: float | None = None
    _told_redo: float | None = None

    def factor(self, conn: Any, size: int, batch_ms: float) -> int:
        """By how much to divide the next batch of ``size`` (1: not at all); ``batch_ms`` is its
        expected duration."""
        if not self.enabled:
            return 1
        try:
            if not self.trigger_bytes:
                max_wal, completion, segment, timeout = dbapi.fetch_all(conn, _CHECKPOINT_SETTINGS)[0]
                self.trigger_bytes = max(segment, (max_wal // (1 + completion) // segment - 1) * segment)
                self.timeout_s = float(timeout)
            since, lsn, age = dbapi.fetch_all(conn, _CHECKPOINT_POSITION)[0]
        except PermanentError as exc:  # pg_control_checkpoint() revoked, or a server without it
            self.enabled = False
            log.warning(
                "%s: cannot read the checkpoint position (%s): batches are bounded by the statement cap"
                " alone, not cut ahead of a checkpoint",
                self.label,
                exc,
            )
            return 1
        self._lsn, self._last_size = lsn, size  # the batch's WAL is measured from here (:meth:`ended`)
        redo = lsn - since  # the last completed checkpoint's redo point: it moves when a checkpoint ends
        # A checkpoint is running (its own redo point is not public until it ends) ...
        running = since >= self.trigger_bytes or age >= self.timeout_s
        if running and self._measured_redo == redo:
            return 1  # ... and a cut batch has measured its full-page writes: the size knows them
        # ... or one may start during the next batch (headroom of one more: the WAL estimate is the
        # last batch's, and other sessions write WAL too).
        near_wal = since + 2 * (self._wal_per_row or 0.0) * size >= self.trigger_bytes
        near_time = age < self.timeout_s <= age + 2 * batch_ms / 1000
        if not (running or near_wal or near_time):
            return 1
        if running:
            self._measured_redo = redo
        if self._told_redo != redo:
            self._told_redo = redo
            log.info(
                "%s: a checkpoint is %s (%.0f of %.0f MB of WAL, %.0f of %.0f s since the last one):"
                " batches cut to 1/%d until one is measured with its full-page writes",
                self.label,
                "running" if running else "near",
                since / 2**20,
                self.trigger_bytes / 2**20,
                age,
                self.timeout_s,
                FULL_PAGE_SHRINK,
            )
        self._last_size = max(1, size // FULL_PAGE_SHRINK)
        return FULL_PAGE_SHRINK

    @property
    def wal_per_row(self) -> float | None:
        """The WAL per row of the last batch measured (bytes, with what other sessions wrote during it), or
        None."""
        return self._wal_per_row

    def sent(self, size: int) -> None:
        """The next batch's size, when it is not the one :meth:`factor` was given."""
        self._last_size = size

    def ended(self, conn: Any, rows: int) -> None:
        """After a committed batch of ``rows`` that :meth:`factor` saw start: its WAL per row, from the
        position read then to now. Measured over the batch alone, not from one batch to the next: other
        workers' batches and the foreground's writes in between are not this batch's."""
        lsn, self._lsn = self._lsn, None
        if not self.enabled or lsn is None or rows <= 0:
            return
        try:
            now = float(dbapi.fetch_all(conn, _WAL_POSITION)[0][0])
        except PermanentError:
            return
        self._wal_per_row = max(0.0, now - lsn) / rows


def conflict_backoff(attempt: int, rng: random.Random) -> float:
    """Seconds to pause before a batch's ``attempt``-th consecutive retry after a serialization failure:
    :data:`CONFLICT_BACKOFF_BASE_S` doubling per attempt up to :data:`CONFLICT_BACKOFF_CAP_S`, with jitter
    in [half, whole] of it, so that chunks conflicting with each other do not retry in lockstep; below
    the cap each pause is at least the one before it."""
    step = min(CONFLICT_BACKOFF_CAP_S, CONFLICT_BACKOFF_BASE_S * 2 ** max(0, attempt - 1))
    return rng.uniform(step / 2, step)


@dataclass
class Pacer:
    """Everything that sizes and spaces one chunk's batches: the adaptive size (:class:`BatchSizer`),
    cut ahead of a checkpoint (:class:`CheckpointWatch`), capped by a statement timeout, and paused
    after each batch to keep the chunk within ``max_duty_cycle``.

    The engine asks :meth:`next_size` before a batch, sets :meth:`statement_timeout_ms` in it, reports
    it to :meth:`observe` once committed (or to :meth:`cut_short` when the cap cancelled it) and calls
    :meth:`rest` between batches."""

    sizer: BatchSizer
    statement_timeout_ms: int
    duty_cycle: float = 1.0
    watch: CheckpointWatch | None = None
    sleep: Callable[[float], None] = time.sleep
    label: str = ""
    cut: list[float] = field(default_factory=list)
    # The policy's target_batch_ms: the sizer's aim is at most this (:meth:`aim_for`), the statement cap
    # always this.
    target_ms: int = 0
    # The most WAL a batch may write (bytes, :data:`BURST_WAL_BYTES` below a duty cycle of 1), or None.
    burst_wal_bytes: float | None = None

    def __post_init__(self) -> None:
        self.target_ms = self.target_ms or self.sizer.target_ms

    @classmethod
    def for_policy(
        cls, policy: RetentionPolicy, start: int | None = None, *, label: str = "", sleep: Callable[[float], None]
    ) -> Pacer:
        adaptive = bool(policy.target_batch_ms)
        return cls(
            sizer=BatchSizer.for_policy(policy, start),
            statement_timeout_ms=policy.statement_timeout_ms,
            duty_cycle=policy.max_duty_cycle,
            watch=CheckpointWatch(label) if adaptive else None,
            sleep=sleep,
            label=label,
        )

    @property
    def size(self) -> int:
        return self.sizer.size

    def next_size(self, conn: Any) -> int:
        size = self.sizer.size
        if self.watch is None or size <= self.sizer.smallest:
            return size
        size = max(self.sizer.smallest, size // self.watch.factor(conn, size, self.sizer.target_ms))
        per_row = self.watch.wal_per_row
        if self.burst_wal_bytes and per_row and size * per_row > self.burst_wal_bytes:
            # The sizer starts from the cap too: when it lifts, batches grow back by MAX_STEP at most.
            size = self.sizer.size = max(self.sizer.smallest, int(self.burst_wal_bytes / per_row))
            self.watch.sent(size)
        return size

    def aim_for(self, duty: float, longest_rest_s: float) -> None:
        """Aim the batches at the policy's target, or shorter at a low ``duty`` cycle: short enough that
        the rest after each is at most ``longest_rest_s`` (the budget's period), down to
        :data:`SHORTEST_AIM_MS`, and writing at most :data:`BURST_WAL_BYTES` of WAL. The statement cap
        stays the target's: a batch sized for the old aim is not cancelled for the new one, the next one
        is sized for it."""
        if not self.target_ms:
            return
        aim = self.target_ms
        if duty < 1:
            aim = min(aim, max(SHORTEST_AIM_MS, int(longest_rest_s * 1000 * duty / (1 - duty))))
        self.sizer.target_ms = aim
        self.burst_wal_bytes = BURST_WAL_BYTES if duty < 1 else None

    def statement_timeout(self, size: int) -> int:
        """The batch's ``statement_timeout``: the policy's, capped at :data:`STATEMENT_CAP` times the
        target unless the batch is as small as it may get (then a cut could not help)."""
        if not self.target_ms or size <= self.sizer.smallest:
            return self.statement_timeout_ms
        return min(self.statement_timeout_ms, max(1, int(self.target_ms * STATEMENT_CAP)))

    def observe(self, ms: float, *, full: bool, size: int) -> int:
        return self.sizer.observe(ms, full=full, size=size)

    def ended(self, conn: Any, rows: int) -> None:
        """After a committed batch that touched ``rows`` rows: the checkpoint watch measures its WAL."""
        if self.watch is not None:
            self.watch.ended(conn, rows)

    def cut_short(self, exc: RetryableError, size: int, ms: float) -> bool:
        """True when ``exc`` is this batch's own cap firing (then the next batch is a quarter as big and
        the engine retries the range); False for any other error, to be raised."""
        if exc.sqlstate != "57014" or self.statement_timeout(size) >= self.statement_timeout_ms:
            return False
        if not self.sizer.cut_short(size):
            return False
        self.cut.append(ms)
        log.warning(
            "%s: a batch of %d rows ran past %d ms and was rolled back: retrying its range %d at a time",
            self.label,
            size,
            self.statement_timeout(size),
            self.sizer.size,
        )
        return True

    def rest(
        self, ms: float, duty: float | None = None, *, tick: Callable[[], None] | None = None, every_s: float = 0.0
    ) -> float:
        """After a batch of ``ms``, pause so that batches take at most ``duty_cycle`` (or ``duty``, the
        database budget's) of the wall time; returns the seconds paused.

        :param tick: called every ``every_s`` seconds of the pause (not at its end)."""
        duty = self.duty_cycle if duty is None else duty
        if duty >= 1 or ms <= 0:
            return 0.0
        pause = ms / 1000 * (1 / duty - 1)
        left = pause
        while tick is not None and every_s > 0 and left > every_s:
            self.sleep(every_s)
            left -= every_s
            tick()
        self.sleep(left)
        return pause


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
