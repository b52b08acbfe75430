"""The budget's controller (:func:`~airflow_retention.core.running.controller.decide`) driven period by period
with fake signals: the clock is the loop over observation periods, the foreground is a canary latency made up
for each. No database: the shared state and the slots are tests/core/running/test_budget.py's."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from airflow_retention.core.db.pressure import PAUSE, RECORD, STEP, Signal
from airflow_retention.core.policy.budget import Budget
from airflow_retention.core.running.controller import (
    CANARY,
    DUTY_STEPS,
    SIGNAL_FLOOR,
    SLOW_START,
    Decision,
    Step,
    Thresholds,
    decide,
    first_level,
    floor_level,
    ladder,
    start_level,
)

BASELINE = 2.0  # ms: upper threshold 4.0 (2x), lower 2.8 (1.4x)
QUIET, BAND, LOUD = 2.0, 3.5, 9.0
TOP = len(ladder(4)) - 1  # 4 batches at once, at the default max_workers


class Periods:
    """The controller's state carried from one observation period to the next, as the ledger carries it."""

    def __init__(self, budget: Budget | None = None, level: int | None = None) -> None:
        self.budget = budget or Budget()
        self.level = start_level() if level is None else level
        self.quiet = 0
        self.decisions: list[Decision] = []

    def period(
        self,
        canary_ms: float | None,
        signals: Sequence[Signal] = (),
        *,
        free_connections: float | None = None,
    ) -> Decision:
        decision = decide(
            self.budget, self.level, self.quiet, canary_ms, BASELINE, signals, free_connections=free_connections
        )
        self.level, self.quiet = decision.level, decision.quiet
        self.decisions.append(decision)
        return decision

    def run(self, canaries: Sequence[float | None]) -> list[str]:
        return [self.period(c).move for c in canaries]


def high(name: str, effect: str = STEP) -> Signal:
    return Signal(name, 5.0, 1.0, effect)


def low(name: str, effect: str = STEP) -> Signal:
    return Signal(name, 0.0, 1.0, effect)


def unreadable(name: str, effect: str = STEP) -> Signal:
    return Signal(name, None, None, effect, error="permission denied")


def test_the_ladder_from_the_floor_to_max_workers_and_where_it_starts() -> None:
    steps = ladder(4)
    assert steps[: len(DUTY_STEPS)] == [Step(1, d) for d in DUTY_STEPS]
    assert steps[len(DUTY_STEPS) :] == [Step(1, 1.0), Step(2, 1.0), Step(3, 1.0), Step(4, 1.0)]
    assert steps[start_level()] == Step(1, 1.0)
    assert [s.duty for s in steps] == sorted(s.duty for s in steps)  # lowest first
    assert ladder(1)[-1] == Step(1, 1.0) and len(ladder(1)) == start_level() + 1
    assert Step(2, 0.35).describe() == "2 batch(es) at once, busy 35% of the time"
    # The floor's steps are under 1 %: never "busy 0%".
    assert [Step(1, d).describe() for d in (0.005, 0.0025, 0.01)] == [
        "1 batch(es) at once, busy 0.5% of the time",
        "1 batch(es) at once, busy 0.25% of the time",
        "1 batch(es) at once, busy 1% of the time",
    ]


def test_a_budget_starts_at_full_speed_only_when_nobody_else_works() -> None:
    assert first_level(0) == start_level()
    assert first_level(1) == first_level(None) == SLOW_START == SIGNAL_FLOOR
    assert ladder(4)[SLOW_START] == Step(1, 0.1)
    # From there, up one step per quiet_periods: full speed after five climbs.
    p = Periods(Budget(quiet_periods=3), level=SLOW_START)
    levels = [p.period(QUIET).level for _ in range(15)]
    assert levels[-1] == start_level() and levels.count(SLOW_START) == 2


def test_up_one_step_only_after_quiet_periods_quiet_periods_in_a_row() -> None:
    p = Periods(Budget(quiet_periods=3))
    assert p.run([QUIET, QUIET]) == ["hold", "hold"]
    assert (p.level, p.quiet) == (start_level(), 2)
    assert p.period(QUIET).move == "up"
    assert (p.level, p.quiet) == (start_level() + 1, 0)  # the count starts again after each step
    assert p.decisions[-1].step == Step(2, 1.0)
    # A period in the band between the thresholds breaks the run of quiet ones.
    assert p.run([QUIET, QUIET, BAND, QUIET, QUIET]) == ["hold"] * 5
    assert p.period(QUIET).move == "up"
    # Up to max_workers and no further.
    moves = p.run([QUIET] * 12)
    assert moves.count("up") == 1 and p.level == TOP
    assert p.decisions[-1].step == Step(4, 1.0)


def test_down_one_step_in_the_period_the_latency_crosses_the_upper_threshold() -> None:
    p = Periods(level=TOP)
    p.quiet = 2  # one quiet period short of a step up: a loud one resets the count
    d = p.period(LOUD)
    assert (d.move, d.level, d.quiet, d.paused) == ("down", TOP - 1, 0, False)
    assert d.causes == (CANARY,)
    assert d.reasons == (f"{CANARY} 9.0 ms > 4.0 ms (baseline 2.0 ms)",)
    # Every loud period one step more, down to the signals' floor (one batch, busy 10 % of the time), and
    # it stays: the steps below are the WAL rate's.
    moves = p.run([LOUD] * 20)
    assert moves[: TOP - 1] == ["down"] * (TOP - 1)
    assert p.level == SIGNAL_FLOOR and p.decisions[-1].step == Step(1, 0.1)
    assert p.period(LOUD).level == SIGNAL_FLOOR
    # Below it (the WAL rate took it there), a loud canary holds it where it is.
    d = decide(Budget(), 1, 0, LOUD, BASELINE, [])
    assert (d.move, d.level) == ("down", 1)
    # Both at once: the WAL rate's step, however far.
    d = decide(Budget(), start_level(), 0, LOUD, BASELINE, [wal(400.0)], foreground=2)
    assert d.step == Step(1, 0.01) and set(d.causes) == {CANARY, "wal_rate"}  # 1.0 x 7 / 400 = 0.0175


def test_a_step_signal_above_its_limit_steps_down_and_a_record_signal_does_not() -> None:
    p = Periods(level=TOP)
    d = p.period(QUIET, [high("lock_waiters"), low("connections"), high("autovacuum", RECORD)])
    assert (d.move, d.level, d.causes) == ("down", TOP - 1, ("lock_waiters",))
    assert d.reasons == ("lock_waiters 5 > 1",)
    # Both at once: one step, two causes.
    d = p.period(LOUD, [high("lock_waiters")])
    assert (d.move, d.level, d.causes) == ("down", TOP - 2, ("lock_waiters", CANARY))
    # Autovacuum only recorded (yield_to_autovacuum false): a quiet period.
    d = p.period(QUIET, [high("autovacuum", RECORD)])
    assert (d.move, d.quiet) == ("hold", 1)


def test_inside_the_band_the_budget_holds_and_says_why() -> None:
    p = Periods(level=start_level() + 1)
    for _ in range(10):
        d = p.period(BAND)
        assert (d.move, d.level, d.quiet) == ("hold", start_level() + 1, 0)
    assert d.reasons == (f"{CANARY} 3.5 ms between 2.8 and 4.0 ms",) and d.causes == ()


def test_at_most_one_step_per_period_under_any_foreground() -> None:
    rng = random.Random(31)
    p = Periods(Budget(quiet_periods=2))
    for _ in range(2000):
        before = p.level
        d = p.period(rng.choice([QUIET, QUIET, BAND, LOUD, rng.uniform(0.5, 12.0)]))
        assert abs(d.level - before) <= 1
        assert d.move == {1: "up", -1: "down", 0: d.move}[d.level - before]
        assert 0 <= d.level <= TOP
    assert {d.move for d in p.decisions} == {"up", "down", "hold"}


def test_a_step_load_goes_down_within_one_period_and_back_up_after_it_falls() -> None:
    """The foreground rises for 5 periods, then falls: down at once, one step a period, then up one step per
    quiet_periods quiet periods, never down again (no oscillation)."""
    p = Periods(Budget(quiet_periods=3), level=start_level() + 2)  # 3 batches at once before the load
    moves = p.run([QUIET] * 2 + [LOUD] * 5 + [QUIET] * 30)
    levels = [d.level for d in p.decisions]
    assert moves[:2] == ["hold", "hold"]
    assert moves[2:7] == ["down"] * 5  # from the load's first period
    assert levels[2:7] == [start_level() + 1, start_level(), start_level() - 1, start_level() - 2, start_level() - 3]
    # After the load: up every third period back to the top (six steps), then held there.
    assert moves[7:] == ["hold", "hold", "up"] * 6 + ["hold"] * 12
    assert levels[-1] == TOP


def test_a_pause_signal_pauses_every_batch_and_keeps_the_step() -> None:
    p = Periods(level=start_level() + 1)
    p.quiet = 2
    lag = Signal("replica_lag", 45_000.0, 30_000.0, PAUSE, "ms")
    for _ in range(3):
        d = p.period(QUIET, [lag, low("connections")])
        assert (d.move, d.paused, d.level, d.quiet) == ("pause", True, start_level() + 1, 0)
    assert d.causes == ("replica_lag",) and d.reasons == ("replica_lag 45000ms > 30000ms",)
    # A pause outranks a step down: the step is kept for when the pause ends.
    d = p.period(LOUD, [lag])
    assert (d.move, d.level) == ("pause", start_level() + 1)
    d = p.period(QUIET, [low("replica_lag", PAUSE)])
    assert (d.move, d.paused, d.quiet) == ("hold", False, 1)


def test_the_connections_free_beyond_the_reserve_cap_the_batches_at_once() -> None:
    p = Periods(level=TOP)
    d = p.period(QUIET, free_connections=2.5)
    assert d.step == Step(2, 1.0) and d.level == start_level() + 1
    # Quiet periods do not raise it past the cap...
    for _ in range(6):
        d = p.period(QUIET, free_connections=2.0)
        assert (d.move, d.step) == ("hold", Step(2, 1.0))
    # ...until connections are free again.
    assert p.period(QUIET, free_connections=40.0).step == Step(3, 1.0)
    # No connection free at all: one batch at a time still (the floor of the cap), at the duty cycle it had.
    p = Periods(level=start_level() - 2)
    d = p.period(QUIET, free_connections=0.0)
    assert d.level == start_level() - 2 and d.step == Step(1, DUTY_STEPS[-2])
    assert Periods(level=TOP).period(QUIET, free_connections=-5.0).step == Step(1, 1.0)


@pytest.mark.parametrize("effect", [STEP, PAUSE])
def test_an_unreadable_signal_is_ignored_open_and_counts_as_high_closed(effect: str) -> None:
    signal = unreadable("replica_lag", effect)
    opened = Periods(Budget(on_unreadable="open"), level=start_level() + 1)
    assert opened.period(QUIET, [signal]).move == "hold"
    closed = Periods(Budget(on_unreadable="closed"), level=start_level() + 1)
    d = closed.period(QUIET, [signal])
    assert d.move == ("pause" if effect == PAUSE else "down")
    assert d.paused == (effect == PAUSE)
    assert d.causes == ("replica_lag",) and d.reasons == ("replica_lag unreadable (permission denied)",)


def test_an_unreadable_canary_steps_down_closed_only() -> None:
    closed = Periods(Budget(on_unreadable="closed"), level=start_level() + 1)
    d = closed.period(None)
    assert (d.move, d.causes, d.reasons) == ("down", (CANARY,), (f"{CANARY} unreadable",))
    opened = Periods(Budget(on_unreadable="open"), level=start_level() + 1)
    assert opened.period(None).move == "hold"


def test_thresholds_relative_to_the_baseline_with_a_floor_or_absolute() -> None:
    assert Thresholds.of(Budget(), 10.0) == Thresholds(20.0, 14.0)
    # A baseline of half a millisecond: at least 1.5 ms above it, and 0.75 ms for the lower one.
    assert Thresholds.of(Budget(), 0.5) == Thresholds(2.0, 1.25)
    absolute = Budget(upper_latency_ms="50ms", lower_latency_ms="20ms")
    assert Thresholds.of(absolute, 0.5) == Thresholds(50.0, 20.0)
    p = Periods(absolute, level=start_level())
    assert p.period(30.0).move == "hold" and p.period(60.0).move == "down"
    assert p.run([10.0] * 3) == ["hold", "hold", "up"]


def test_no_climb_to_more_batches_at_once_than_are_wanted() -> None:
    """One worker alone: quiet periods earn nothing above one batch at once (four arriving later start from
    what was used); duty steps below it still climb."""
    budget = Budget(quiet_periods=1)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [], demand=1)
    assert (d.move, d.level) == ("hold", start_level())
    d = decide(budget, start_level() - 2, 0, QUIET, BASELINE, [], demand=1)
    assert (d.move, d.level) == ("up", start_level() - 1)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [], demand=3)
    assert (d.move, d.step) == ("up", Step(2, 1.0))


def test_with_no_foreground_the_canary_neither_lowers_nor_holds_the_budget() -> None:
    """The canary slowed by the purges' own WAL on an idle database: nobody pays it, so no step down."""
    p = Periods(Budget(quiet_periods=1))
    d = decide(p.budget, start_level(), 0, LOUD, BASELINE, [], foreground=0)
    assert (d.move, d.level) == ("up", start_level() + 1)
    d = decide(p.budget, start_level(), 0, LOUD, BASELINE, [], foreground=2)
    assert (d.move, d.causes) == ("down", (CANARY,))
    # Other signals still count with nobody there.
    d = decide(p.budget, start_level(), 0, LOUD, BASELINE, [high("lock_waiters")], foreground=0)
    assert (d.move, d.causes) == ("down", ("lock_waiters",))


def wal(mb_s: float, limit: float = 10.0) -> Signal:
    return Signal("wal_rate", mb_s, limit, STEP, "MB/s", lower=limit * 0.7, foreground_only=True, proportional=True)


def test_the_wal_rate_steps_down_above_its_limit_holds_in_its_band_and_is_quiet_below() -> None:
    """Above max_wal_rate with someone working: down (checkpoints forced back to back stall their commits);
    between 70 % and the limit: hold, saying why; below: quiet, so the budget climbs."""
    budget = Budget(quiet_periods=1)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [wal(12.0)], foreground=3)
    # Straight to the step whose work brings it under 7 MB/s: 7/12 of full duty, so 0.5.
    assert (d.move, d.step, d.causes) == ("down", Step(1, 0.5), ("wal_rate",))
    assert d.reasons == ("wal_rate 12MB/s > 10MB/s",)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [wal(8.0)], foreground=3)
    assert (d.move, d.level, d.quiet) == ("hold", start_level(), 0)
    assert d.reasons == ("wal_rate 8MB/s between 7 and 10MB/s",)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [wal(6.5)], foreground=3, demand=2)
    assert (d.move, d.level) == ("up", start_level() + 1)


def test_the_wal_rate_is_nobodys_cost_on_an_idle_database() -> None:
    """No other session works: forced checkpoints stall nobody, the purge keeps its speed."""
    budget = Budget(quiet_periods=1)
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [wal(50.0)], foreground=0, demand=2)
    assert (d.move, d.level) == ("up", start_level() + 1)
    # Unknown foreground (None): counted, as anyone might be there.
    d = decide(budget, start_level(), 0, QUIET, BASELINE, [wal(50.0)], foreground=None)
    assert d.move == "down"


def test_a_wal_rate_far_above_its_limit_goes_straight_to_the_step_that_fits_it() -> None:
    """The WAL rate grows with the work allowed: at full duty, 40 MB/s against a limit of 10 (lower 7) needs
    at most 7/40 of the work: the highest step at or below it (duty 0.1), in one period."""
    d = decide(Budget(), start_level(), 0, QUIET, BASELINE, [wal(40.0)], foreground=2)
    assert d.move == "down" and d.step == Step(1, 0.1)
    # From 4 batches at once, 15 MB/s: 7/15 of 4 is 1.87 batches: one batch at full duty.
    d = decide(Budget(), TOP, 0, QUIET, BASELINE, [wal(15.0)], foreground=2)
    assert d.step == Step(1, 1.0)
    # Just above, at 4 batches: 7/10.5 of 4 is 2.67 batches: two at once (the lower threshold is the aim).
    d = decide(Budget(), TOP, 0, QUIET, BASELINE, [wal(10.5)], foreground=2)
    assert d.step == Step(2, 1.0)
    # At most the step below, however little above: 10.1 MB/s at two batches: one step.
    d = decide(Budget(), start_level() + 1, 0, QUIET, BASELINE, [wal(10.1, limit=10.0)], foreground=2)
    assert d.step == Step(1, 1.0)
    # Far above, from the floor's neighbour: the floor (min_duty, 0.5 % by default), not the ladder's lowest step.
    floor = floor_level(Budget())
    assert floor > 0 and DUTY_STEPS[floor] == Budget().min_duty == 0.005
    d = decide(Budget(), floor + 1, 0, QUIET, BASELINE, [wal(1000.0)], foreground=2)
    assert d.level == floor and d.step == Step(1, 0.005)
    # A policy whose floor is lower goes on down to it.
    low = Budget(min_duty=0.0025)
    d = decide(low, floor + 1, 0, QUIET, BASELINE, [wal(1000.0)], foreground=2)
    assert d.level == 0 and d.step == Step(1, 0.0025)
    # Another policy's budget already below this one's floor: a step down never raises it.
    d = decide(Budget(), 0, 0, QUIET, BASELINE, [wal(1000.0)], foreground=2)
    assert d.level == 0
