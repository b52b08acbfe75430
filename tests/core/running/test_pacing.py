"""Pacing: the adaptive batch size (pure, then end to end on the real server) and the throttle's pressure
checks against the real PostgreSQL (lock waiters, a probe), plus the policy fields that configure them."""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any

import pytest

from airflow_retention.core.errors import PolicyError, RetryableError
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy, Throttle
from airflow_retention.core.policy.validation import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MIN_BATCH_SIZE, MAX_BATCH_SIZE
from airflow_retention.core.running.engine import BatchReport, run_chunk
from airflow_retention.core.running.pacing import (
    BURST_WAL_BYTES,
    CONFLICT_BACKOFF_BASE_S,
    CONFLICT_BACKOFF_CAP_S,
    FULL_PAGE_SHRINK,
    MAX_BACKOFF_MS,
    SHORTEST_AIM_MS,
    BatchSizer,
    CheckpointWatch,
    Pacer,
    Throttler,
    conflict_backoff,
    read_pressure,
)
from tests.conftest import connect
from tests.core.helpers import (
    CUTOFF,
    create_events,
    eligible_ids,
    expected_batches,
    fill_events,
    ledger_chunk,
    ledger_chunks,
    make_policy,
    rows,
    scalar,
    wait_for,
)

# -- BatchSizer ---------------------------------------------------------------------------------------


def test_a_slow_batch_shrinks_the_next_one_at_once_by_its_whole_ratio() -> None:
    sizer = BatchSizer(1000, 10, 100_000, 200)
    assert sizer.observe(400, full=True) == 500  # twice the target: half
    assert sizer.observe(260, full=True) == 384  # 1.3x the target: by the ratio, 500 * 200/260
    # Seven times the target (full-page writes after a checkpoint): a seventh, not half and half again.
    assert sizer.observe(1400, full=True) == 54
    assert sizer.observe(240, full=True) == 54  # within 1.25x: no change
    assert sizer.observe(100_000, full=True) == 10  # never below the smallest


def test_a_rest_ticks_at_every_interval_inside_it_and_sleeps_the_same_in_all() -> None:
    """A rest holding a slot shows it is alive (the budget's heartbeat): a tick every ``every_s`` inside the
    pause, none at its end; the seconds slept are the pause's, in pieces."""
    slept: list[float] = []
    ticks: list[float] = []
    pacer = Pacer(sizer=BatchSizer(100, 10, 1000, 200), statement_timeout_ms=60_000, sleep=slept.append)
    assert pacer.rest(20, 0.01, tick=lambda: ticks.append(sum(slept)), every_s=0.5) == pytest.approx(1.98)
    assert slept == pytest.approx([0.5, 0.5, 0.5, 0.48]) and ticks == pytest.approx([0.5, 1.0, 1.5])
    slept.clear()
    assert pacer.rest(2, 0.01, tick=lambda: ticks.append(-1), every_s=0.5) == pytest.approx(0.198)
    assert slept == pytest.approx([0.198]) and len(ticks) == 3  # shorter than the interval: no tick


def test_at_a_low_duty_cycle_batches_aim_short_enough_to_rest_at_most_a_period() -> None:
    """Busy 1 % of the time with a 2 s period: a 200 ms batch would rest 19.8 s; aimed at 20 ms it rests
    2 s, the same share in pieces a tenth the size. The statement cap stays the policy target's."""
    pacer = Pacer(sizer=BatchSizer(10_000, 10, 100_000, 200), statement_timeout_ms=60_000, sleep=lambda s: None)
    pacer.aim_for(0.01, 2.0)
    assert pacer.sizer.target_ms == 20
    assert pacer.observe(200, full=True, size=10_000) == 1000  # ten times the aim: a tenth
    assert pacer.rest(20, 0.01) == pytest.approx(1.98)
    assert pacer.statement_timeout(1000) == 300  # 1.5x the policy's 200 ms, not the aim's
    pacer.aim_for(0.5, 2.0)
    assert pacer.sizer.target_ms == 200  # 2 s of rest fit a 2 s batch: the policy's target
    pacer.aim_for(1.0, 2.0)
    assert pacer.sizer.target_ms == 200
    pacer.aim_for(0.0001, 2.0)
    assert pacer.sizer.target_ms == SHORTEST_AIM_MS == 10  # never below it
    fixed = Pacer(sizer=BatchSizer(10_000, 10, 100_000, 0), statement_timeout_ms=60_000, sleep=lambda s: None)
    fixed.aim_for(0.01, 2.0)
    assert fixed.sizer.target_ms == 0  # a fixed batch size stays fixed


class KnownWal(CheckpointWatch):
    """A checkpoint watch that never cuts and knows the WAL per row: 400 bytes."""

    def factor(self, conn: Any, size: int, batch_ms: float) -> int:
        return 1

    @property
    def wal_per_row(self) -> float | None:
        return 400.0


def test_below_a_duty_cycle_of_one_a_batch_writes_at_most_a_burst_of_wal_and_grows_back_from_it() -> None:
    watch = KnownWal("test")
    pacer = Pacer(
        sizer=BatchSizer(20_000, 10, 100_000, 200), statement_timeout_ms=60_000, watch=watch, sleep=lambda s: None
    )
    assert pacer.next_size(None) == 20_000  # at full duty: no cap (8 MB of WAL)
    pacer.aim_for(0.05, 2.0)
    capped = BURST_WAL_BYTES // 400
    assert pacer.next_size(None) == capped == 655
    assert watch._last_size == capped  # the next WAL per row is measured at the size sent
    pacer.aim_for(1.0, 2.0)
    assert pacer.next_size(None) == capped  # the cap lifted: the sizer starts from it ...
    assert pacer.observe(40, full=True, size=capped) == 2 * capped  # ... and grows by MAX_STEP at most
    pacer.aim_for(0.05, 2.0)
    pacer.sizer.size = 10
    assert pacer.next_size(None) == 10  # the smallest batch is never cut


def test_a_batch_cut_by_the_checkpoint_watch_is_measured_at_its_own_size() -> None:
    sizer = BatchSizer(8000, 10, 100_000, 200)
    # The watch cut a batch to 2,000 rows and it still took 400 ms: the rate is 2,000 per 400 ms.
    assert sizer.observe(400, full=True, size=2000) == 1000
    # A cut batch that was fast says the full size is fine: it never grows past a doubling of the cut.
    sizer = BatchSizer(8000, 10, 100_000, 200)
    assert sizer.observe(40, full=True, size=2000) == 8000


def test_a_batch_cut_short_by_the_statement_cap_retries_a_quarter() -> None:
    sizer = BatchSizer(8000, 500, 100_000, 200)
    assert sizer.cut_short(8000) and sizer.size == 2000
    assert sizer.cut_short(1000) and sizer.size == 500
    assert not sizer.cut_short(500)  # the smallest batch runs uncapped: its timeout is the policy's own


def test_after_a_cut_the_size_never_grows_past_half_the_cut_batch_again() -> None:
    """A block chunk's cold tail with nothing to delete: fast batches double the size at once, and the
    next big one read cold pages past the cap again, five cuts in 7 s at the same size. After a cut the
    size grows back, but only to half the batch that was cut, for the rest of the chunk."""
    sizer = BatchSizer(172_624, 500, 1_000_000, 20)
    assert sizer.cut_short(172_624) and sizer.size == 43_156
    grown = [sizer.observe(1, full=True) for _ in range(6)]  # each far below the target: doubled at once
    assert grown == [86_312] * 6, grown  # 172,624 // 2; without the ceiling: 86,312, 172,624, 345,248, ...
    assert sizer.cut_short(86_312) and sizer.size == 21_578
    assert [sizer.observe(1, full=True) for _ in range(3)] == [43_156] * 3  # the lower ceiling holds
    assert sizer.observe(100, full=True) == 8_631  # shrinking is not limited by it


def test_fast_batches_grow_the_size_only_after_two_in_a_row() -> None:
    sizer = BatchSizer(1000, 10, 100_000, 200)
    assert sizer.observe(100, full=True) == 1000  # one calm batch (half the target): not yet
    assert sizer.observe(100, full=True) == 2000  # the second: by the ratio, 2
    assert sizer.observe(120, full=True) == 2000
    assert sizer.observe(120, full=True) == 3333  # ratio 200/120
    # A batch within the band breaks the calm streak.
    assert sizer.observe(100, full=True) == 3333
    assert sizer.observe(200, full=True) == 3333
    assert sizer.observe(100, full=True) == 3333
    # And so does a slow one, which shrinks at once.
    assert sizer.observe(400, full=True) == 1666
    assert sizer.observe(100, full=True) == 1666
    assert sizer.observe(100, full=True) == 3332
    # Exactly a quarter of the target is still only calm.
    assert sizer.observe(50, full=True) == 3332


def test_a_batch_far_below_the_target_doubles_the_size_at_once() -> None:
    sizer = BatchSizer(1000, 10, 100_000, 200)
    assert sizer.observe(49, full=True) == 2000  # under a quarter of the target: nothing to oscillate around
    assert sizer.observe(1, full=True) == 4000  # at most double, however fast
    assert sizer.observe(100, full=True) == 4000  # back to the two-batch rule


def test_size_stays_within_min_and_max() -> None:
    sizer = BatchSizer(1000, 300, 1500, 200)
    for _ in range(4):
        sizer.observe(1, full=True)
    assert sizer.size == 1500
    for _ in range(6):
        sizer.observe(100_000, full=True)
    assert sizer.size == 300
    assert BatchSizer(10, 300, 1500, 200).size == 300  # a start outside the bounds is clamped
    assert BatchSizer(9000, 300, 1500, 200).size == 1500


def test_batches_that_ended_their_range_early_are_ignored() -> None:
    sizer = BatchSizer(1000, 10, 100_000, 200)
    assert sizer.observe(5000, full=False) == 1000  # a short last batch says nothing about the size
    assert sizer.observe(1, full=False) == 1000
    assert sizer.observe(100, full=True) == 1000
    assert sizer.observe(5000, full=False) == 1000  # ... nor does it break a calm streak
    assert sizer.observe(100, full=True) == 2000


def test_target_zero_keeps_the_size_fixed() -> None:
    sizer = BatchSizer(1000, 10, 100_000, 0)
    for ms in (1, 1, 1, 5000, 5000, 0.5, 0.5):
        assert sizer.observe(ms, full=True) == 1000
    policy = make_policy("s", batch_size=700)  # helpers' policies: target_batch_time 0
    fixed = BatchSizer.for_policy(policy)
    assert (fixed.size, fixed.target_ms) == (700, 0)
    for ms in (1, 1, 1, 9000, 9000):
        fixed.observe(ms, full=True)
    assert fixed.size == 700


def test_for_policy_starts_from_the_given_size_within_bounds() -> None:
    policy = make_policy("s", batch_size=1000, target_batch_time="200ms", min_batch_size=100, max_batch_size=5000)
    assert BatchSizer.for_policy(policy).size == 1000
    assert BatchSizer.for_policy(policy, 3000).size == 3000
    assert BatchSizer.for_policy(policy, 50_000).size == 5000
    assert BatchSizer.for_policy(policy, 7).size == 100


def test_a_steady_workload_settles_without_oscillating() -> None:
    """A batch costs 0.1 ms per key (2000 keys hit the 200 ms target): the size climbs, then stays put."""
    sizer = BatchSizer(100, 50, 100_000, 200)
    sizes = []
    for _ in range(60):
        sizes.append(sizer.size)
        sizer.observe(sizer.size * 0.1, full=True)
    settled = sizes[-40:]
    assert len(set(settled)) == 1, sizes
    assert 0.75 * 200 <= settled[0] * 0.1 <= 1.25 * 200
    assert sizes == sorted(sizes)  # never went back down on the way up

    # The same with ±10 % noise: the size may still move, but it never swings back and forth.
    rng = random.Random(5)
    sizer = BatchSizer(1000, 50, 100_000, 200)
    noisy = []
    for _ in range(200):
        noisy.append(sizer.size)
        sizer.observe(sizer.size * 0.1 * rng.uniform(0.9, 1.1), full=True)
    changes = sum(a != b for a, b in itertools.pairwise(noisy))
    assert 1 <= changes <= 3, noisy
    assert all(1000 <= s <= 2700 for s in noisy)
    assert all(0.75 * 2000 <= s <= 1.25 * 2000 for s in noisy[-150:])


# -- policy fields ------------------------------------------------------------------------------------


def _refused(field: str, **fields: Any) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        make_policy("s", **fields)
    assert info.value.field == field, info.value
    assert f"field {field!r}" in str(info.value)
    return info.value


def test_policy_pacing_defaults() -> None:
    policy = RetentionPolicy.from_dict(
        {
            "name": "p",
            "conn_id": "c",
            "table": "public.events",
            "key_column": "id",
            "timestamp_column": "created_at",
            "retention": "30 days",
        }
    )
    assert (policy.batch_size, policy.target_batch_ms) == (5000, 200)
    assert (policy.min_batch_size, policy.max_batch_size) == (DEFAULT_MIN_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE)
    assert policy.min_batch_size < policy.batch_size < policy.max_batch_size <= MAX_BATCH_SIZE
    assert policy.throttle == Throttle() and not policy.throttle.enabled
    assert (policy.ledger_keep_days, policy.vacuum_after_rows, policy.queue) == (180, None, None)
    # The defaults stretch to include batch_size.
    assert make_policy("s", batch_size=100).min_batch_size == 100
    big = make_policy("s", batch_size=MAX_BATCH_SIZE, chunk_rows=MAX_BATCH_SIZE)
    assert (big.min_batch_size, big.max_batch_size) == (DEFAULT_MIN_BATCH_SIZE, MAX_BATCH_SIZE)


@pytest.mark.parametrize("value", [0, "0", "off", False])
def test_target_batch_time_zero_means_fixed(value: object) -> None:
    assert make_policy("s", target_batch_time=value).target_batch_ms == 0


@pytest.mark.parametrize(("value", "ms"), [("20ms", 20), ("1s", 1000), (350, 350)])
def test_target_batch_time_is_read_as_milliseconds(value: object, ms: int) -> None:
    assert make_policy("s", target_batch_time=value).target_batch_ms == ms


@pytest.mark.parametrize("value", ["fast", "-5ms", None, [1]])
def test_bad_target_batch_time_is_refused(value: object) -> None:
    _refused("target_batch_time", target_batch_time=value)


def test_min_and_max_batch_size_must_include_batch_size() -> None:
    assert "got 101" in str(_refused("min_batch_size", batch_size=100, min_batch_size=101))
    assert "got 99" in str(_refused("max_batch_size", batch_size=100, max_batch_size=99))
    _refused("max_batch_size", batch_size=100, max_batch_size=1_000_001)
    _refused("min_batch_size", min_batch_size=0)
    _refused("min_batch_size", min_batch_size="50")
    policy = make_policy("s", batch_size=100, min_batch_size=100, max_batch_size=100)
    assert (policy.min_batch_size, policy.max_batch_size) == (100, 100)


@pytest.mark.parametrize(
    ("throttle", "words"),
    [
        ({"max_lag": "1s"}, "unknown key 'max_lag'"),
        ({"backoff": "1s", "give_up": "1m"}, "unknown key 'give_up'"),
        ({"probe": "select 1"}, "probe and probe_max go together"),
        ({"probe_max": 3}, "probe and probe_max go together"),
        ({"probe": "select 1", "probe_max": "3"}, "probe_max: must be a number"),
        ({"probe": "select 1; select 2", "probe_max": 3}, "probe: must be one query"),
        ({"probe": " ", "probe_max": 3}, "probe: must be a non-empty"),
        ({"max_replica_lag": "soon"}, "max_replica_lag: cannot read 'soon'"),
        ({"max_lock_waiters": -1}, "max_lock_waiters: must be a non-negative integer"),
        ({"max_lock_waiters": "2"}, "max_lock_waiters: must be a non-negative integer"),
        ({"backoff": "x"}, "backoff: cannot read 'x'"),
        ({"give_up_after": "later"}, "give_up_after: cannot read 'later'"),
        ("10s", "must be a mapping"),
    ],
)
def test_bad_throttle_settings_name_the_setting(throttle: object, words: str) -> None:
    error = _refused("throttle", throttle=throttle)
    assert words in str(error)


def test_throttle_settings_are_read_and_round_trip() -> None:
    policy = make_policy(
        "s",
        throttle={
            "max_replica_lag": "10s",
            "max_lock_waiters": 0,
            "probe": "select count(*) from pg_stat_activity;",
            "probe_max": 5,
            "backoff": "1s",
            "give_up_after": "10 min",
        },
        queue="purges",
        vacuum_after_rows=1000,
        ledger_keep_days=35,
    )
    assert policy.throttle == Throttle(10_000, 0, "select count(*) from pg_stat_activity", 5.0, 1000, 600_000)
    assert policy.throttle.enabled
    assert (policy.queue, policy.vacuum_after_rows, policy.ledger_keep_days) == ("purges", 1000, 35)
    assert RetentionPolicy.from_dict(policy_to_dict(policy)) == policy


@pytest.mark.parametrize(
    ("field", "value"), [("ledger_keep_days", 34), ("queue", " "), ("queue", 3), ("vacuum_after_rows", 0)]
)
def test_other_new_fields_are_checked(field: str, value: object) -> None:
    _refused(field, **{field: value})


def test_duty_cycle_and_chunk_time_defaults_and_round_trip() -> None:
    policy = make_policy("s", chunk_rows=None)
    assert (policy.max_duty_cycle, policy.target_chunk_ms, policy.chunk_rows) == (1.0, 45_000, None)
    policy = make_policy("s", max_duty_cycle=0.25, target_chunk_time="2 min")
    assert (policy.max_duty_cycle, policy.target_chunk_ms) == (0.25, 120_000)
    assert make_policy("s", max_duty_cycle=1).max_duty_cycle == 1.0
    assert RetentionPolicy.from_dict(policy_to_dict(policy)) == policy


@pytest.mark.parametrize("value", [0, -0.5, 1.01, float("nan"), "0.5", True, None])
def test_bad_max_duty_cycle_is_refused(value: object) -> None:
    assert "max_duty_cycle" in str(_refused("max_duty_cycle", max_duty_cycle=value))


@pytest.mark.parametrize("value", ["500ms", 999, "soon", 0, "2 days"])
def test_bad_target_chunk_time_is_refused(value: object) -> None:
    _refused("target_chunk_time", target_chunk_time=value)


# -- duty cycle, statement cap, checkpoint watch ---------------------------------------------------


def test_duty_cycle_pauses_after_each_batch_in_proportion_to_it(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema, 3000)
    policy = make_policy(schema, batch_size=500, target_batch_time=0, max_duty_cycle=0.25)
    (chunk,) = plan_run(conn, policy, CUTOFF).chunks
    eligible = eligible_ids(admin, table)
    pauses: list[float] = []
    result = run_chunk(conn, policy, CUTOFF, chunk, sleep=pauses.append)
    assert result.rows_deleted == len(eligible) and eligible_ids(admin, table) == []
    # After every batch but the last: three times its duration (batches 25 % of the time).
    assert len(pauses) == result.batches - 1 >= 4
    for pause, batch in zip(pauses, result.batch_log, strict=False):
        assert pause == pytest.approx(3 * batch.ms / 1000)
    assert result.duty_seconds == pytest.approx(sum(pauses))
    # The default never pauses.
    assert Pacer.for_policy(make_policy(schema), sleep=pauses.append).rest(100.0) == 0.0


def test_statement_cap_applies_above_the_smallest_batch_only() -> None:
    policy = make_policy("s", target_batch_time="200ms", batch_size=5000, min_batch_size=500, statement_timeout="60s")
    pacer = Pacer.for_policy(policy, sleep=lambda _: None)
    assert pacer.statement_timeout(5000) == 300
    assert pacer.statement_timeout(500) == 60_000
    # A policy's own timeout below the cap is kept, and its firing is not a cut.
    tight = Pacer.for_policy(
        make_policy("s", target_batch_time="200ms", statement_timeout="100ms"), sleep=lambda _: None
    )
    assert tight.statement_timeout(100) == 100
    assert not tight.cut_short(RetryableError("statement timeout", "57014"), 100, 100.0)
    # Another error is never a cut.
    assert not pacer.cut_short(RetryableError("lock timeout", "55P03"), 5000, 10.0)
    assert pacer.cut_short(RetryableError("statement timeout", "57014"), 5000, 300.0) and pacer.size == 1250
    assert Pacer.for_policy(make_policy("s", target_batch_time=0), sleep=lambda _: None).statement_timeout(5000) == (
        policy.statement_timeout_ms
    )


def test_checkpoint_watch_cuts_one_batch_per_running_checkpoint(conn: Any, admin: Any) -> None:
    watch = CheckpointWatch("test")
    assert watch.factor(conn, 8000, 200) in (1, FULL_PAGE_SHRINK)  # reads the real server's settings
    assert watch.enabled and watch.trigger_bytes >= 2**20 and watch.timeout_s >= 30
    # Far from any trigger: no cut.
    watch = CheckpointWatch("test", trigger_bytes=2.0**62, timeout_s=10.0**9)
    assert [watch.factor(conn, 8000, 200) for _ in range(3)] == [1, 1, 1]
    # Past the WAL trigger (a checkpoint running): one cut batch measures its full-page writes, then no more
    # until another checkpoint.
    watch = CheckpointWatch("test", trigger_bytes=1.0, timeout_s=10.0**9)
    assert [watch.factor(conn, 8000, 200) for _ in range(3)] == [FULL_PAGE_SHRINK, 1, 1]
    # The next batch's WAL may reach the trigger: cut ahead of it.
    watch = CheckpointWatch("test", trigger_bytes=2.0**62, timeout_s=10.0**9)
    watch.factor(conn, 8000, 200)
    assert watch._lsn is not None
    watch._lsn -= 2.0**61  # as if the batch wrote that much WAL: the trigger is one batch away
    watch.ended(conn, 8000)
    assert watch.wal_per_row == pytest.approx(2.0**61 / 8000, rel=1e-6)
    assert watch.factor(conn, 8000, 200) == FULL_PAGE_SHRINK
    # checkpoint_timeout within two batches: cut ahead of it as well.
    watch = CheckpointWatch("test", trigger_bytes=2.0**62, timeout_s=10.0**9)
    age = scalar(admin, "SELECT extract(epoch FROM now() - checkpoint_time) FROM pg_control_checkpoint()")
    watch.timeout_s = float(age) + 2  # the next batch, expected to take 2 s, may run into it
    assert watch.factor(conn, 8000, 2000) == FULL_PAGE_SHRINK


def test_checkpoint_watch_measures_a_batchs_wal_from_its_start_not_from_the_batch_before(
    conn: Any, admin: Any, schema: str
) -> None:
    rows(admin, f'CREATE TABLE "{schema}".w (id bigint, pad text)')
    watch = CheckpointWatch("test", trigger_bytes=2.0**62, timeout_s=10.0**9)
    watch.factor(conn, 1000, 200)
    rows(admin, f"INSERT INTO \"{schema}\".w SELECT g, repeat('x', 200) FROM generate_series(1, 1000) g")
    watch.ended(conn, 1000)
    first = watch.wal_per_row
    assert first is not None and 200 < first < 2000  # a row and its WAL record
    # Another worker's batch between this one's: not counted in the next measure.
    rows(admin, f"INSERT INTO \"{schema}\".w SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g")
    watch.factor(conn, 1000, 200)
    rows(admin, f"INSERT INTO \"{schema}\".w SELECT g, repeat('x', 200) FROM generate_series(1, 1000) g")
    watch.ended(conn, 1000)
    assert watch.wal_per_row == pytest.approx(first, rel=0.5)
    watch.ended(conn, 1000)  # no batch started since: nothing measured
    assert watch.wal_per_row == pytest.approx(first, rel=0.5)


# -- the throttle against the real server --------------------------------------------------------------


class FakeSleep:
    """Records the pauses instead of sleeping; ``then`` runs after each one (with the pause count)."""

    def __init__(self, then: Any = None) -> None:
        self.pauses: list[float] = []
        self.then = then

    def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        if self.then is not None:
            self.then(len(self.pauses))


def test_disabled_throttle_reads_nothing() -> None:
    sleep = FakeSleep()
    Throttler(make_policy("s"), "x", sleep=sleep).wait_until_calm(object())  # not a connection: never used
    assert sleep.pauses == []


def test_backoff_is_jittered_and_doubles_up_to_the_cap(conn: Any) -> None:
    policy = make_policy("s", throttle={"probe": "SELECT 1", "probe_max": 0, "backoff": "1s", "give_up_after": "5 min"})
    sleep = FakeSleep()
    throttler = Throttler(policy, "jitter", sleep=sleep, rng=random.Random(11))
    with pytest.raises(RetryableError, match=r"give_up_after 300 s\): pressure probe returned 1 > 0") as info:
        throttler.wait_until_calm(conn)
    assert "Committed batches stay" in str(info.value)
    steps = [min(1000 * 2**i, MAX_BACKOFF_MS) / 1000 for i in range(len(sleep.pauses))]
    assert all(step / 2 <= p <= step for p, step in zip(sleep.pauses, steps, strict=True)), sleep.pauses
    assert steps.count(60) >= 3  # reached the one-minute cap and stayed there
    assert max(sleep.pauses) <= 60 and max(sleep.pauses) > 32  # only a capped step can pause above 32 s
    assert len({round(p / s, 4) for p, s in zip(sleep.pauses, steps, strict=True)}) == len(steps)  # jittered
    assert sum(sleep.pauses[:-1]) < 300 <= sum(sleep.pauses)  # gave up at the first check past 5 minutes
    assert throttler.take() == (len(sleep.pauses), pytest.approx(sum(sleep.pauses)))
    assert throttler.take() == (0, 0.0)


def small_table(admin: Any, schema: str, count: int = 3000) -> str:
    table = create_events(admin, schema)
    fill_events(admin, table, count)
    return table


def test_lock_waiters_pause_the_purge_then_it_gives_up_and_the_retry_completes(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    table = small_table(admin, schema)
    policy = make_policy(
        schema, throttle={"max_lock_waiters": 0, "backoff": "10ms", "give_up_after": "200ms"}, lock_timeout="2s"
    )
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    eligible = eligible_ids(admin, table)
    first = expected_batches(admin, table, chunk.lo, chunk.hi, policy.batch_size)[0]
    assert 0 < len(first.eligible) < len(eligible)
    assert read_pressure(conn, policy).calm

    holder = connect(driver)  # a long transaction on the table: compatible with the purge
    with holder.cursor() as cur:
        cur.execute(f"LOCK TABLE {table} IN ROW SHARE MODE")
    waiter_errors: list[BaseException] = []

    def migrate() -> None:  # a migration's ALTER TABLE, queued behind the long transaction
        c = connect(driver)
        try:
            with c.cursor() as cur:
                cur.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            c.rollback()
        except BaseException as exc:  # noqa: BLE001 - reported below
            waiter_errors.append(exc)
        finally:
            c.close()

    waiter = threading.Thread(target=migrate)
    waiting = f"SELECT count(*) FROM pg_locks WHERE relation = '{table}'::regclass AND NOT granted"

    def queue_the_migration(report: BatchReport) -> None:  # after the first committed batch
        if not waiter.is_alive() and report.lo == chunk.lo:
            waiter.start()
            wait_for(lambda: scalar(admin, waiting) == 1, 10, "the ACCESS EXCLUSIVE request to queue")

    sleep = FakeSleep()
    try:
        with pytest.raises(RetryableError) as info:
            run_chunk(conn, policy, CUTOFF, chunk, on_batch=queue_the_migration, sleep=sleep)
        assert f"1 lock request(s) waiting on {policy.table} > 0" in str(info.value)
        reading = read_pressure(conn, policy)
        assert reading.reasons == (f"1 lock request(s) waiting on {policy.table} > 0",)
        assert str(policy.table) == f"{schema}.events"
        # Paused until give_up_after (200 ms of pauses), then stopped; the ledger shows the first batch only.
        assert sum(sleep.pauses[:-1]) < 0.2 <= sum(sleep.pauses)
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        assert (row["state"], row["batches"], row["rows_deleted"], row["next_key"]) == (
            "running",
            1,
            len(first.eligible),
            first.hi,
        )
        assert row["backoffs"] == len(sleep.pauses) > 0
        assert row["backoff_seconds"] == pytest.approx(sum(sleep.pauses))
        assert "lock request(s) waiting on" in row["last_error"]
    finally:
        holder.rollback()  # the migration gets its lock, and lets go at once
        holder.close()
        if waiter.is_alive() or waiter.ident is not None:
            waiter.join(30)
    assert waiter_errors == []
    assert read_pressure(conn, policy).calm
    assert eligible_ids(admin, table) == eligible[len(first.eligible) :]  # (read once the queue is gone)
    retry = run_chunk(conn, policy, CUTOFF, chunk, sleep=sleep)
    assert (retry.resumed_from, retry.backoffs) == (first.hi, 0)
    assert retry.rows_deleted == len(eligible) - len(first.eligible)
    assert eligible_ids(admin, table) == []
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert (row["state"], row["rows_deleted"], row["attempts"]) == ("complete", len(eligible), 2)
    assert row["backoffs"] == len(sleep.pauses)


def test_a_probe_above_its_maximum_pauses_and_the_purge_resumes_when_it_falls(
    schema: str, conn: Any, admin: Any
) -> None:
    table = small_table(admin, schema)
    pressure = f'"{schema}".pressure'
    rows(admin, f"CREATE TABLE {pressure} (v integer)")
    rows(admin, f"INSERT INTO {pressure} VALUES (10)")
    policy = make_policy(
        schema,
        throttle={"probe": f"SELECT v FROM {pressure}", "probe_max": 5, "backoff": "10ms", "give_up_after": "10s"},
    )
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    eligible = eligible_ids(admin, table)
    assert read_pressure(conn, policy).reasons == ("pressure probe returned 10 > 5",)

    def ease(pauses: int) -> None:
        assert eligible_ids(admin, table) == eligible  # paused before the first batch: nothing deleted yet
        if pauses == 2:
            rows(admin, f"UPDATE {pressure} SET v = 5")  # at the maximum is calm

    sleep = FakeSleep(ease)
    result = run_chunk(conn, policy, CUTOFF, chunk, sleep=sleep)
    assert len(sleep.pauses) == 2
    assert 0.005 <= sleep.pauses[0] <= 0.01 and 0.01 <= sleep.pauses[1] <= 0.02
    assert (result.backoffs, result.rows_deleted) == (2, len(eligible))
    assert result.backoff_seconds == pytest.approx(sum(sleep.pauses))
    assert [b.backoffs for b in result.batch_log] == [2] + [0] * (result.batches - 1)
    assert eligible_ids(admin, table) == []
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert (row["state"], row["backoffs"], row["last_error"]) == ("complete", 2, None)
    assert row["backoff_seconds"] == pytest.approx(sum(sleep.pauses))


# -- adaptive batch size, end to end ----------------------------------------------------------------


def _sizes_follow_the_sizer(
    policy: RetentionPolicy, chunk_hi: int, log: list[BatchReport], start: int | None = None
) -> list[int]:
    """The engine used exactly the sizes a BatchSizer started at ``start`` (default ``batch_size``)
    picks from the durations it measured (replayed here), or a quarter of one where the checkpoint
    watch cut a batch (a checkpoint may be running on the shared test server). Returns the sizes."""
    sizes = [b.size for b in log]
    replay = BatchSizer(
        start or policy.batch_size, policy.min_batch_size, policy.max_batch_size, policy.target_batch_ms
    )
    picks = []  # the sizer's own sizes, cut or not: a batch after a cut one goes back up to 4x + 3 of it
    for b in log:
        picks.append(replay.size)
        cut = max(replay.smallest, replay.size // FULL_PAGE_SHRINK)
        assert b.size in (replay.size, cut), [(b.size, round(b.ms, 1)) for b in log]
        replay.observe(b.ms, full=b.hi < chunk_hi, size=b.size)
    for before, after in itertools.pairwise(picks):
        assert before // FULL_PAGE_SHRINK <= after <= FULL_PAGE_SHRINK * before, (picks, sizes)
    return sizes


def test_batch_size_grows_towards_the_target_and_the_next_chunk_starts_there(
    schema: str, conn: Any, admin: Any
) -> None:
    table = create_events(admin, schema)
    fill_events(admin, table, 50_000)
    eligible = eligible_ids(admin, table)
    policy = make_policy(
        schema,
        target_batch_time="20ms",
        batch_size=100,
        min_batch_size=50,
        max_batch_size=20_000,
        chunk_rows=len(eligible) // 2 + 1,
    )
    plan = plan_run(conn, policy, CUTOFF)
    assert len(plan.chunks) == 2
    first = run_chunk(conn, policy, CUTOFF, plan.chunks[0])
    sizes = _sizes_follow_the_sizer(policy, plan.chunks[0].hi, first.batch_log)
    assert max(sizes) >= 400, sizes  # 100 keys take far less than 15 ms here
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, plan.chunks[0].key)
    assert (row["min_batch_size"], row["max_batch_size"]) == (min(sizes), max(sizes))
    assert row["last_batch_size"] == first.last_batch_size == sizes[-1]
    assert row["rows_deleted"] == first.rows_deleted == plan.chunks[0].rows_planned

    second = run_chunk(conn, policy, CUTOFF, plan.chunks[1])
    # Not back to batch_size: it starts where the first chunk settled.
    _sizes_follow_the_sizer(policy, plan.chunks[1].hi, second.batch_log, start=row["last_batch_size"])
    assert eligible_ids(admin, table) == []
    rows_ = ledger_chunks(admin, policy.ledger_schema, plan.run_key)
    assert [r["last_batch_size"] for r in rows_] == [first.last_batch_size, second.last_batch_size]


def test_a_slow_batch_is_cut_short_by_the_statement_cap_and_retried_smaller(schema: str, conn: Any, admin: Any) -> None:
    table = small_table(admin, schema, 3000)
    # Each row that reaches the condition sleeps 0.5 ms: 1000 keys take about 500 ms, 25 times the
    # target; the cap (1.5x the target, 30 ms) cancels such a batch, and its range is retried smaller.
    policy = make_policy(
        schema,
        condition="status <> 'open' AND pg_sleep(0.0005) IS NOT NULL",
        target_batch_time="20ms",
        batch_size=1000,
        min_batch_size=50,
        max_batch_size=20_000,
    )
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    eligible = eligible_ids(admin, table)
    result = run_chunk(conn, policy, CUTOFF, chunk)
    sizes = [b.size for b in result.batch_log]
    assert result.batches_cut >= 2, sizes  # 1000 and 250 rows both take longer than 30 ms
    assert sizes[0] <= 62, [(b.size, round(b.ms)) for b in result.batch_log]
    # Only batches at the smallest size run uncapped; every other committed batch stayed near the cap.
    assert all(b.ms < 200 for b in result.batch_log if b.size > policy.min_batch_size), sizes
    assert result.rows_deleted == len(eligible)
    assert eligible_ids(admin, table) == []
    row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
    assert row["max_batch_size"] == max(sizes) < 1000  # the cancelled batches left no trace but the log
    assert row["rows_deleted"] == len(eligible)


# -- serialization failures and lock waits ------------------------------------------------------------


def test_conflict_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    rng = random.Random(7)
    pauses = [conflict_backoff(n, rng) for n in range(1, 12)]
    for n, pause in enumerate(pauses, start=1):
        step = min(CONFLICT_BACKOFF_CAP_S, CONFLICT_BACKOFF_BASE_S * 2 ** (n - 1))
        assert step / 2 <= pause <= step
    below_cap = pauses[:7]  # 10 ms doubled six times is 640 ms; the 8th step is the cap
    assert below_cap == sorted(below_cap)  # [s/2, s] then [s, 2s]: never shorter than the one before
    assert pauses[0] <= 0.01 and all(0.5 <= p <= 1.0 for p in pauses[7:])
    again = random.Random(7)
    assert [conflict_backoff(n, again) for n in range(1, 12)] == pauses  # seeded: repeatable


def _lock_waiters(cur: Any) -> int:
    cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
    return int(cur.fetchone()[0])


def test_a_one_pass_batch_in_conflict_with_a_writer_backs_off_longer_each_time(
    schema: str, conn: Any, admin: Any, driver: str
) -> None:
    """A second connection changes an eligible row of the first batch while the batch's DELETE waits
    for it, four times running: each time the batch fails with 40001 and is taken again, after a pause
    that grows (from 5-10 ms), then goes through; every eligible row is deleted."""
    table = create_events(admin, schema)
    fill_events(admin, table, 3000, tenant="1 + mod(g, 3)")
    policy = make_policy(schema, chunk_by="block", tenant_column="tenant_id", batch_size=500)
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    eligible = eligible_ids(admin, table)
    writer, watcher = connect(driver), connect(driver)
    watcher.autocommit = True
    conflicts = 4
    pauses: list[float] = []
    timers: list[threading.Thread] = []

    def commit_once_waited_on() -> None:
        with watcher.cursor() as cur:
            wait_for(lambda: _lock_waiters(cur) > 0, 30, "the batch's DELETE waiting for the changed row")
        writer.commit()

    def change_a_row() -> None:
        """Update an eligible row of the first blocks, uncommitted; commit it once the batch waits on it."""
        with writer.cursor() as cur:
            cur.execute(f"UPDATE {table} SET payload = 'changed' WHERE id = %(i)s", {"i": eligible[len(pauses)]})
        timer = threading.Thread(target=commit_once_waited_on)
        timers.append(timer)
        timer.start()

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) < conflicts:
            change_a_row()

    try:
        change_a_row()
        result = run_chunk(conn, policy, CUTOFF, chunk, sleep=sleep, rng=random.Random(1))
    finally:
        for timer in timers:
            timer.join()
        writer.rollback()
        writer.close()
        watcher.close()
    assert len(pauses) == conflicts, pauses
    assert pauses == sorted(pauses) and pauses[-1] >= 4 * CONFLICT_BACKOFF_BASE_S > 2 * pauses[0], pauses
    assert all(p <= CONFLICT_BACKOFF_CAP_S for p in pauses)
    assert result.rows_deleted == len(eligible) and eligible_ids(admin, table) == []
    assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["rows_deleted"] == len(eligible)


def test_a_wait_for_the_ledger_row_past_the_statement_cap_does_not_cut_the_batch(
    schema: str, conn: Any, admin: Any, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another attempt's batch holds the chunk's ledger row for a second, five times the statement cap
    (1.5 x 200 ms), then commits. The batch waits for it (up to lock_timeout), and neither the cap nor
    the adaptive size counts the wait: the batch keeps its size, is not cut, and the next is not smaller."""
    table = small_table(admin, schema)
    policy = make_policy(
        schema, target_batch_time="200ms", batch_size=1000, min_batch_size=50, max_batch_size=20_000, lock_timeout="5s"
    )
    # The checkpoint watch cuts a batch near a checkpoint, which the rest of a busy suite's WAL often runs:
    # not what this test is about (its own tests are above).
    monkeypatch.setattr(CheckpointWatch, "factor", lambda self, conn, size, batch_ms: 1)
    (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
    eligible = eligible_ids(admin, table)
    holder = connect(driver)
    with holder.cursor() as cur:
        cur.execute(
            f'SELECT 1 FROM "{policy.ledger_schema}".chunks WHERE run_key = %(r)s AND chunk_key = %(c)s FOR UPDATE',
            {"r": plan.run_key, "c": chunk.key},
        )
    release = threading.Timer(1.0, holder.rollback)
    release.start()
    try:
        result = run_chunk(conn, policy, CUTOFF, chunk)
    finally:
        release.join()
        holder.close()
    sizes = [(b.size, round(b.ms)) for b in result.batch_log]
    assert result.batches_cut == 0, sizes
    assert result.batch_log[0].size == 1000, sizes
    assert result.batch_log[0].ms < 900, sizes  # the batch's own time, not the second it waited
    assert len(result.batch_log) >= 2 and result.batch_log[1].size >= 1000, sizes
    assert result.rows_deleted == len(eligible) and eligible_ids(admin, table) == []
