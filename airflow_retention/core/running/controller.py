"""The budget's controller: from one observation of the pressure signals to how much of the database the
purges may use next period. Plain functions of their inputs (no clock, no database), so that the
hysteresis is tested with fake signals.

The budget is a ladder of steps, from the lowest (one batch at a time, busy 0.25 % of the time) through
longer duty cycles to more batches at once (:func:`ladder`). The controller moves at most one step per
observation period:

- down one step in the period the canary's latency crosses its upper threshold or a signal whose effect
  is ``step`` is above its limit (promptly: no waiting for a second look), down to :data:`SIGNAL_FLOOR`;
  a signal that grows with the work allowed (the WAL rate) takes it straight to the step whose share of
  the work brings the signal under its lower threshold, as low as the policy's floor (``min_duty``);
- up one step only after ``quiet_periods`` periods in a row with the latency below the lower threshold and
  every signal below its limit, or its own lower threshold where it has one (the WAL rate): slowly, so that
  a foreground that comes back is not chased;
- held in between (the band between the thresholds is the hysteresis);
- paused, with its step kept, while a signal whose effect is ``pause`` is above its limit (a standby's
  replay lag, the WAL archive's backlog);

and never above the step whose batch count exceeds the connections free beyond the reserve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from airflow_retention.core.db.pressure import PAUSE, STEP, Signal, fmt
from airflow_retention.core.policy.budget import LOWEST_DUTY, Budget

# The duty cycles of one batch at a time, below the full one; from there, one more batch at a time per step.
# The floor is low: beside pgbench, a purge must write WAL at about 1 % of its full speed for checkpoints to
# stay timed (docs/performance.md, "The database budget"); a policy's min_duty says how low it may go. The
# default, 0.5 %: beside the same pgbench in one run, 1.21x its p99 alone where 1 % read 1.77x, in 1.85
# times the purge's time (docs/performance.md, "A reference of ten minutes, and the tail at the floor").
DUTY_STEPS = (LOWEST_DUTY, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75)
# The lowest step the canary and the other signals step down to (busy 10 %): the steps below it are the WAL
# rate's, whose value says how far down it must go. The canary's latency says only that the purge should
# do less: on a loaded test machine it held purges at 1 % for minutes where 10 % had been enough.
SIGNAL_FLOOR = DUTY_STEPS.index(0.1)
# Thresholds relative to a baseline of a millisecond or two would trip on the noise of one sample: the
# upper threshold is at least this far above the baseline, the lower one at least LOWER_MARGIN_MS.
UPPER_MARGIN_MS = 1.5
LOWER_MARGIN_MS = 0.75
CANARY = "canary_latency"


@dataclass(frozen=True)
class Step:
    """Batches of all purges at once on the database, and the share of time each batch slot is busy."""

    concurrency: int
    duty: float

    def describe(self) -> str:
        # The floor's steps are under 1 %: "busy 0% of the time" read as a stuck purge.
        return f"{self.concurrency} batch(es) at once, busy {self.duty * 100:.3g}% of the time"


def ladder(max_workers: int) -> list[Step]:
    """Every step of a budget of at most ``max_workers`` batches at once, lowest first."""
    return [Step(1, d) for d in DUTY_STEPS] + [Step(c, 1.0) for c in range(1, max_workers + 1)]


def floor_level(budget: Budget) -> int:
    """The lowest step ``budget`` steps down to: the first whose duty cycle is at least its ``min_duty``."""
    return next(i for i, d in enumerate(DUTY_STEPS) if d >= budget.min_duty - 1e-9)


def start_level() -> int:
    """One batch at a time, full duty: where a budget starts on a database nobody else works on."""
    return len(DUTY_STEPS)


# Where a budget starts while other sessions work: busy 10 % of the time, one step up per quiet_periods
# quiet periods (30 s to full speed with the defaults). Started at full speed beside pgbench, one worker
# wrote 400 MB of WAL in the first period, before any observation could see it: a checkpoint forced on
# the foreground at once (docs/performance.md, "The database budget").
SLOW_START = SIGNAL_FLOOR


def first_level(foreground: int | None) -> int:
    """Where a budget starting afresh begins: :func:`start_level` when no other session works, else
    (also when unknown) :data:`SLOW_START`."""
    return start_level() if foreground == 0 else SLOW_START


@dataclass(frozen=True)
class Thresholds:
    upper_ms: float
    lower_ms: float

    @classmethod
    def of(cls, budget: Budget, baseline_ms: float) -> Thresholds:
        if budget.upper_latency_ms is not None and budget.lower_latency_ms is not None:
            return cls(budget.upper_latency_ms, budget.lower_latency_ms)
        return cls(
            max(baseline_ms * budget.upper, baseline_ms + UPPER_MARGIN_MS),
            max(baseline_ms * budget.lower, baseline_ms + LOWER_MARGIN_MS),
        )


@dataclass(frozen=True)
class Decision:
    """The budget for the next period and why."""

    level: int
    step: Step
    quiet: int
    paused: bool
    move: str  # "up", "down", "hold", "pause"
    reasons: tuple[str, ...] = ()
    # The signals behind the move, by name (``canary_latency``, ``lock_waiters``, ...): the keys under
    # which pauses are recorded.
    causes: tuple[str, ...] = field(default=())


def decide(
    budget: Budget,
    level: int,
    quiet: int,
    canary_ms: float | None,
    baseline_ms: float,
    signals: Sequence[Signal],
    *,
    free_connections: float | None = None,
    demand: int | None = None,
    foreground: int | None = None,
) -> Decision:
    """The next period's budget from this period's observation.

    :param level: the current step's index in :func:`ladder`.
    :param quiet: quiet periods in a row so far.
    :param canary_ms: the canary's latency this period (None: it could not be measured).
    :param baseline_ms: the canary's latency before the purges started.
    :param free_connections: connections free beyond the reserve, counting the purges' own batch slots
        as free (None: unknown): the highest step allowed.
    :param demand: batches the purges want at once: slots busy, workers queued for one and the observer
        (None: unknown). The budget does not climb to more batches at once than are wanted: a quiet
        period with one worker says nothing about four, and four arriving later start from what was
        earned, not from a level nobody used.
    :param foreground: other client sessions busy in the last period (None: unknown). With none, the
        canary's latency is the purges' own (their WAL flushed before its commit) and nobody pays it: it
        does not lower the budget, and neither do the signals marked ``foreground_only`` (the WAL rate),
        so that a purge on an idle database runs at full speed.
    """
    steps = ladder(budget.max_workers)
    level = max(0, min(level, len(steps) - 1))
    if free_connections is not None:
        while level > 0 and steps[level].concurrency > max(1, int(free_connections)):
            level -= 1
    limits = Thresholds.of(budget, baseline_ms)
    closed = budget.on_unreadable == "closed"
    pausing = [s for s in signals if s.effect == PAUSE and (s.high or (closed and s.value is None))]
    if pausing:
        why = tuple(_why(s) for s in pausing)
        return Decision(level, steps[level], 0, True, "pause", why, tuple(s.name for s in pausing))
    if foreground == 0:
        # Nobody else works: a cost only a foreground pays (forced checkpoints) is nobody's.
        signals = [s for s in signals if not s.foreground_only]
    stepping = [s for s in signals if s.effect == STEP and (s.high or (closed and s.value is None))]
    reasons = [_why(s) for s in stepping]
    causes = [s.name for s in stepping]
    if foreground == 0:
        canary_ms = None if canary_ms is None or canary_ms > limits.lower_ms else canary_ms
    if canary_ms is None:
        if closed and foreground != 0:
            reasons.append(f"{CANARY} unreadable")
            causes.append(CANARY)
    elif canary_ms > limits.upper_ms:
        reasons.append(f"{CANARY} {canary_ms:.1f} ms > {limits.upper_ms:.1f} ms (baseline {baseline_ms:.1f} ms)")
        causes.append(CANARY)
    if reasons:
        proportional = [_level_for(steps, level, s) for s in stepping if s.proportional]
        # One step down, not below SIGNAL_FLOOR (a budget the WAL rate took below it stays where it is).
        down = max(level - 1, min(level, SIGNAL_FLOOR)) if len(proportional) < len(reasons) else level
        # Not below this policy's floor; one that another policy's took lower stays where it is.
        level = max(min(level, floor_level(budget)), min([down, *proportional]))
        return Decision(level, steps[level], 0, False, "down", tuple(reasons), tuple(causes))
    loud = [s for s in signals if s.effect == STEP and not s.quiet]
    if (canary_ms is None or canary_ms < limits.lower_ms) and not loud:
        quiet += 1
        if quiet >= budget.quiet_periods and level + 1 < len(steps):
            ceiling = max(1, int(free_connections)) if free_connections is not None else None
            if demand is not None:
                ceiling = min(ceiling, max(1, demand)) if ceiling is not None else max(1, demand)
            if ceiling is None or steps[level + 1].concurrency <= ceiling:
                return Decision(level + 1, steps[level + 1], 0, False, "up")
        return Decision(level, steps[level], quiet, False, "hold")
    # Inside the band: neither calm enough to grow nor loud enough to shrink.
    band = [f"{s.name} {fmt(s.value)}{s.unit} between {fmt(s.lower)} and {fmt(s.limit)}{s.unit}" for s in loud]
    if canary_ms is not None and canary_ms >= limits.lower_ms:
        band.insert(0, f"{CANARY} {canary_ms:.1f} ms between {limits.lower_ms:.1f} and {limits.upper_ms:.1f} ms")
    return Decision(level, steps[level], 0, False, "hold", tuple(band), ())


def _level_for(steps: Sequence[Step], level: int, signal: Signal) -> int:
    """The highest step whose work (batches at once × duty cycle) brings a signal that grows with it from
    its value under its lower threshold, at the work of ``level``."""
    if not signal.value or signal.lower is None:
        return level - 1
    work = steps[level].concurrency * steps[level].duty * signal.lower / signal.value
    fits = [i for i, s in enumerate(steps[:level]) if s.concurrency * s.duty <= work]
    return fits[-1] if fits else 0


def _why(signal: Signal) -> str:
    return signal.describe()
