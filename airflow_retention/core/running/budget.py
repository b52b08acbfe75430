"""The database budget shared by every worker of every purge on one database: before each batch a chunk
takes a batch slot within the budget's concurrency, after it rests (holding the slot) so that the slot is
busy at most the budget's duty cycle, and once per observation period one worker, whichever claims the
period in the ledger, reads the pressure signals and moves the budget (:mod:`.controller`).

The slots are session-level advisory locks: a worker killed mid-batch loses its session, and PostgreSQL
releases its slot with it (no lease to expire, no slot leaked). A worker waiting for a slot queues on one
in PostgreSQL's lock queue, so a worker that releases a slot and asks again goes behind the ones waiting.
A chunk of one tenant (a tenant big enough to be cut into several chunks) first takes one of its tenant's
slots (``max_workers_per_tenant``, half the batch slots by default), so that one busy tenant's chunks never
take every batch slot while other tenants' chunks wait.

Every pause is accounted to its reason (the signal that lowered the budget, ``slots`` when the budget is
simply full, ``tenant_ceiling`` when the chunk's tenant has its most batches running, ``slow_start`` for
the rests of a budget that started slow beside another session, ``max_duty_cycle`` for the policy's own
duty cycle) and written to the chunk's ledger row with its next batch.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from airflow_retention.core.db.pressure import WAL_RATE, Signal, read_signals, read_wal_rate
from airflow_retention.core.errors import RetryableError
from airflow_retention.core.ledger.budget import BudgetState, Slot, TenantSlot
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.controller import decide, first_level, ladder, start_level

log = logging.getLogger(__name__)

BASELINE_SAMPLES = 5
CANARY_SAMPLES = 3
BASELINE_WAIT_S = 0.05
# A state nobody observed for this long belongs to purges that ended: the next one starts the budget
# afresh (its baseline measured before its first batch, from the starting step).
STALE_PERIODS = 10
STALE_MIN_S = 60.0
# Within a run the baseline only goes down: to the canary's median over the last BASELINE_WINDOW periods
# (at least BASELINE_MIN_PERIODS of them) when that is lower. A baseline measured while the server was
# slower (a warm-up, another job ending) made the thresholds loose: beside pgbench, 4 workers, a baseline
# of 2.37 ms against a canary of 1.11 ms at p50, and the budget climbed off its floor 44 times in 29 min.
# Canaries read with the purge at work are no faster than the foreground's alone, and a 30-period median
# does not follow one lucky reading: the baseline ends near the quietest half-minute's median.
BASELINE_WINDOW = 30
BASELINE_MIN_PERIODS = 10
# The WAL rate is measured over this many periods (or since the first observation, when younger): one
# batch at the floor writes its WAL in a fraction of a period and rests for many, so a rate over one
# period is that batch's or nothing; the checkpoints it must stay under are minutes apart.
WAL_WINDOW_PERIODS = 10
TENANT_CEILING = "tenant_ceiling"
SLOW_START_REASON = "slow_start"


class SharedBudget:
    """One chunk attempt's view of the database budget (``policy.budget``).

    :param observer: who observes when this attempt claims a period (the chunk and its host), recorded.
    :param tenant: the chunk's tenant when it has one alone: its batches count against the tenant's ceiling.
    :param clock: monotonic seconds (tests pass a fake).
    :param sleep: how it pauses (tests pass a fake).
    :param read: how the pressure signals are read (tests pass fakes).
    """

    def __init__(
        self,
        policy: RetentionPolicy,
        ledger: Ledger,
        label: str,
        observer: str,
        *,
        tenant: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        read: Callable[[Any, RetentionPolicy], list[Signal]] = read_signals,
    ) -> None:
        self.policy, self.settings, self.ledger = policy, policy.budget, ledger
        self.label, self.observer = label, observer
        self.clock, self.sleep, self.rng, self.read = clock, sleep, rng or random.Random(), read
        self.period_s = self.settings.period_ms / 1000
        self.steps = ladder(self.settings.max_workers)
        self.state: BudgetState | None = None
        self.slot: int | None = None
        ceiling = self.settings.tenant_ceiling
        # No separate ceiling when it allows every slot.
        self.tenant_slots = (
            [TenantSlot(policy.table.sql, tenant, n) for n in range(ceiling)]
            if tenant is not None and ceiling < self.settings.max_workers
            else []
        )
        self.tenant_slot: TenantSlot | None = None
        self._told_tenant = False
        self.next_look = 0.0
        self.pending: dict[str, float] = {}
        # Paused by a signal, or waiting for a slot while nothing moved (:meth:`_wait`), in this attempt:
        # what counts towards give_up_after.
        self.held_s = 0.0
        self._stuck_on: list[int] = []  # the sessions that held the slots through the last wait, if it counted
        self._told: tuple[int, bool, tuple[str, ...]] | None = None
        self._unreadable: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # -- before a batch ---------------------------------------------------------------------------

    def admit(self, conn: Any) -> None:
        """Return holding a batch slot within the budget; pause while a signal says so."""
        if not self.enabled or self.slot is not None:
            return
        self._take_tenant_slot(conn)
        while True:
            state = self._look(conn)
            if state.paused:
                self._pause(state)
                continue
            slot = self._take(conn, state.concurrency)
            if slot is None:
                # Every slot is busy: queue on one for at most a period, then look at the budget again.
                slot = self.rng.randrange(state.concurrency)
                if not self._wait(conn, slot, self._slot_reason(state)):
                    slot = None  # not holding one: giving up with a slot would keep it until the session ends
                    self._give_up_past(state, f"waiting for a batch slot ({self._slot_reason(state)}){self._stuck()}")
            if slot is not None:
                if slot < state.concurrency:
                    self.slot = slot
                    return
                self.ledger.release_slot(conn, slot)  # the budget shrank while it waited

    def _take_tenant_slot(self, conn: Any) -> None:
        """Hold one of the chunk's tenant's slots, queueing (a period at a time) while its others are busy."""
        if not self.tenant_slots or self.tenant_slot is not None:
            return
        for slot in self.tenant_slots:
            if self.ledger.try_slot(conn, slot):
                self.tenant_slot = slot
                return
        if not self._told_tenant:  # once per attempt: the chunk's paused seconds count every wait
            self._told_tenant = True
            log.info(
                "%s: tenant %s already has %d batch(es) running (max_workers_per_tenant): waiting for one to end",
                self.label,
                self.tenant_slots[0].tenant,
                len(self.tenant_slots),
            )
        while True:
            slot = self.rng.choice(self.tenant_slots)
            if self._wait(conn, slot, TENANT_CEILING):
                self.tenant_slot = slot
                return
            self._give_up_past(
                self.state,
                f"waiting for a slot of tenant {slot.tenant} (max_workers_per_tenant {len(self.tenant_slots)})"
                f"{self._stuck()}",
            )

    def _wait(self, conn: Any, slot: Slot, reason: str) -> bool:
        """Queue for ``slot`` for at most a period; the wait is accounted to ``reason``. It counts towards
        ``give_up_after`` only when it ended without the slot and the same sessions held the same slots at
        both ends, none of them having run a statement meanwhile: then no batch of any purge on the
        database began or ended while it waited (a holder hung, or a session holding a slot for another
        reason). A worker that gave its slot back and took it again holds the same slot at both ends, but
        its statements moved its session's times. A wait while the slots change hands is the
        budget shared: four workers at one batch at a time each wait three quarters of the purge. A wait
        for a tenant's slot looks at that tenant's slots alone: the other tenants' batches moving do not
        hide a hung holder of its own."""
        among = self.tenant_slots if isinstance(slot, TenantSlot) else ()
        before = self.ledger.slot_holders(conn, among)
        started = self.clock()
        taken = self.ledger.wait_slot(conn, slot, self.settings.period_ms)
        waited = self.clock() - started
        stalled = not taken and self.ledger.slot_holders(conn, among) == before
        # Named only while the last wait counted: a give-up after one that did not (the pauses having
        # reached give_up_after) would name sessions that moved since.
        self._stuck_on = sorted({holder[0] for holder in before}) if stalled else []
        self._account(reason, waited, waiting=stalled)
        return taken

    def _stuck(self) -> str:
        """Who held the slots through the last wait, if it counted: the sessions for an operator to look at."""
        if not self._stuck_on:
            return ""
        return f", the slots held throughout by backend pid(s) {', '.join(map(str, self._stuck_on))}"

    def _take(self, conn: Any, concurrency: int) -> int | None:
        for slot in range(concurrency):
            if self.ledger.try_slot(conn, slot):
                return slot
        return None

    def _pause(self, state: BudgetState) -> None:
        why = "; ".join(state.reasons) or "a pause signal"
        self._give_up_past(state, f"paused: {why}")
        pause = self.rng.uniform(self.period_s / 2, self.period_s)
        log.warning("%s: database budget paused: %s; looking again in %.1f s", self.label, why, pause)
        self.sleep(pause)
        self._account(state.causes[0] if state.causes else "pause", pause)
        self.next_look = 0.0

    def _give_up_past(self, state: BudgetState | None, doing: str) -> None:
        limit_ms = self.policy.throttle.give_up_after_ms
        if self.held_s * 1000 >= limit_ms:
            budget = (
                f"; budget: {self.steps[state.level].describe()}"
                f"{' (' + '; '.join(state.reasons) + ')' if state.reasons else ''}"
                if state is not None
                else ""
            )
            raise RetryableError(
                f"{self.label}: {doing} for {self.held_s:.1f} s in this attempt (give_up_after"
                f" {limit_ms / 1000:g} s){budget}. Committed batches stay; the task's retry resumes the chunk"
            )

    # -- after a batch ----------------------------------------------------------------------------

    def duty(self) -> float:
        """The duty cycle of the slot held: the budget's, or the policy's own when lower."""
        if not self.enabled or self.state is None:
            return self.policy.max_duty_cycle
        # A step below this policy's floor is another policy's (one budget per database).
        return min(self.policy.max_duty_cycle, max(self.state.duty, self.settings.min_duty))

    def heartbeat(self, conn: Any) -> dict[str, Any]:
        """How a rest taken holding a slot shows it is alive: a statement every quarter period, so that a
        worker queued behind a rest longer than its wait (a batch that overran at a low duty cycle rests
        up to 1 / duty times its length) does not count it as a hung holder. ``{}`` without a slot."""
        if self.slot is None and self.tenant_slot is None:
            return {}
        return {"tick": lambda: self.ledger.touch(conn), "every_s": self.period_s / 4}

    def rested(self, seconds: float) -> None:
        """Account the rest after a batch (taken while holding the slot) to its reason."""
        if seconds <= 0:
            return
        if self.enabled and self.state is not None and self.state.duty < self.policy.max_duty_cycle:
            self._account(self.state.causes[0] if self.state.causes else "budget", seconds, waiting=False)
        else:
            self._account("max_duty_cycle", seconds, waiting=False)

    def release(self, conn: Any) -> None:
        if self.slot is not None:
            slot, self.slot = self.slot, None
            self.ledger.release_slot(conn, slot)
        if self.tenant_slot is not None:
            tenant_slot, self.tenant_slot = self.tenant_slot, None
            self.ledger.release_slot(conn, tenant_slot)

    def release_quietly(self, conn: Any) -> None:
        """After a failed batch: the slot goes with the session anyway if the connection is lost."""
        try:
            self.release(conn)
        except Exception:
            log.debug("%s: could not release batch slot", self.label, exc_info=True)

    def take(self) -> dict[str, float]:
        """The pauses not yet written to the ledger, by reason (seconds)."""
        pending, self.pending = self.pending, {}
        return {k: round(v, 3) for k, v in pending.items()}

    # -- the shared state -------------------------------------------------------------------------

    def _look(self, conn: Any) -> BudgetState:
        now = self.clock()
        if self.state is not None and now < self.next_look:
            return self.state
        start = start_level()
        while True:
            state, claimed = self.ledger.budget_state(
                conn,
                level=start,
                concurrency=self.steps[start].concurrency,
                duty=self.steps[start].duty,
                period_s=self.period_s,
            )
            if claimed or state.baseline_ms is not None:
                break
            # Another worker is measuring the first baseline: no batch until it has, or the baseline would
            # time this batch, not the foreground alone (its claim lapses after a period if it dies).
            self.sleep(BASELINE_WAIT_S)
        if claimed:
            state = self._observe(conn, state)  # it logs its own move
            self._told = (state.level, state.paused, state.reasons)
        self.next_look = now + self.period_s / 2
        self.state = state
        self._tell(state)
        return state

    def _observe(self, conn: Any, state: BudgetState) -> BudgetState:
        stale = state.age_s is None or state.age_s > max(STALE_MIN_S, STALE_PERIODS * self.period_s)
        busy, queued = self.ledger.slots(conn)
        foreground = self.ledger.foreground_sessions(conn, self.period_s, self.settings.ignore_databases)
        level, quiet, baseline, new_baseline = state.level, state.quiet, state.baseline_ms, False
        fresh = stale or baseline is None
        if fresh:
            # A budget starting afresh: the baseline is the foreground alone, before this purge's first batch.
            if busy and baseline is not None:
                log.info("%s: %d batch slot(s) busy: keeping the baseline of %.1f ms", self.label, busy, baseline)
            else:
                baseline = self._canary(conn, BASELINE_SAMPLES)
                new_baseline = True
                if busy:
                    log.warning("%s: baseline measured while %d batch(es) ran: %.1f ms", self.label, busy, baseline)
            level, quiet = first_level(foreground), 0
        assert baseline is not None
        canary = self._canary(conn, CANARY_SAMPLES)
        if not fresh:
            baseline = self._lowered(conn, baseline)
        mark = None if stale else self.ledger.wal_mark(conn, WAL_WINDOW_PERIODS * self.period_s)
        wal, lsn = read_wal_rate(conn, self.policy, *(mark or (None, None)))
        signals = [*self.read(conn, self.policy), wal]
        free = _free_connections(signals, busy)
        # The observer wants a slot too (it observes from admit(), holding none).
        demand = busy + queued + 1
        decision = decide(
            self.settings,
            level,
            quiet,
            canary,
            baseline,
            signals,
            free_connections=free,
            demand=demand,
            foreground=foreground,
        )
        if fresh and decision.move == "hold" and decision.level < start_level():
            decision = replace(
                decision, reasons=(f"slow start: {foreground} other session(s) at work", *decision.reasons)
            )
            causes: tuple[str, ...] | None = (SLOW_START_REASON,)
        elif decision.move in ("down", "pause"):
            causes = decision.causes
        elif decision.level >= start_level():
            causes = ()
        else:
            causes = None  # below the start: the cause that took it there still holds
        self.ledger.record_observation(
            conn,
            level=decision.level,
            quiet=decision.quiet,
            paused=decision.paused,
            concurrency=decision.step.concurrency,
            duty=decision.step.duty,
            move=decision.move,
            canary_ms=canary,
            baseline_ms=baseline,
            new_baseline=new_baseline,
            slots_busy=busy,
            signals={
                "canary_latency": {"value": canary, "baseline": baseline},
                "foreground_sessions": {"value": foreground, "limit": None, "effect": "record", "error": None},
                "batch_demand": {"value": demand, "limit": None, "effect": "record", "error": None},
                **{s.name: s.to_dict() for s in signals if s is not wal},
                WAL_RATE: {**wal.to_dict(), "lsn": lsn},
            },
            reasons=decision.reasons,
            causes=causes,
            observer=self.observer,
        )
        for signal in signals:
            if signal.value is None and signal.error and signal.name not in self._unreadable:
                self._unreadable.add(signal.name)  # once per attempt: the observations record every period
                log.warning("%s: pressure signal %s (on_unreadable: %s)", self.label, signal.describe(),
                            self.settings.on_unreadable)  # fmt: skip
        if decision.move != "hold" or new_baseline:
            # Held down at the floor period after period: said once, when it gets there (the observations
            # record every period's reasons).
            floored = decision.move == "down" and decision.level == level and not new_baseline
            log.log(
                logging.DEBUG if floored else logging.INFO,
                "%s: database budget %s: %s; canary %.1f ms (baseline %.1f ms)%s",
                self.label,
                {"up": "up", "down": "down", "pause": "paused", "hold": "starts at"}[decision.move],
                decision.step.describe(),
                canary,
                baseline,
                f": {'; '.join(decision.reasons)}" if decision.reasons else "",
            )
        return BudgetState(
            level=decision.level,
            quiet=decision.quiet,
            paused=decision.paused,
            concurrency=decision.step.concurrency,
            duty=decision.step.duty,
            baseline_ms=baseline,
            reasons=decision.reasons,
            causes=causes if causes is not None else state.causes,
            age_s=0.0,
        )

    def _lowered(self, conn: Any, baseline: float) -> float:
        """The baseline, or the canary's recent median when that is lower (see :data:`BASELINE_WINDOW`)."""
        median, periods = self.ledger.canary_median(conn, BASELINE_WINDOW)
        if median is None or periods < BASELINE_MIN_PERIODS or median >= baseline:
            return baseline
        if median < baseline * 0.9:  # said when it matters, not for every hundredth of a millisecond
            log.info(
                "%s: database budget's baseline lowered from %.2f to %.2f ms: the canary's median over the last"
                " %d periods (the baseline was measured while the database was slower)",
                self.label,
                baseline,
                median,
                periods,
            )
        return median

    def _canary(self, conn: Any, samples: int) -> float:
        return statistics.median(self.ledger.canary(conn) for _ in range(samples))

    def _tell(self, state: BudgetState) -> None:
        told = (state.level, state.paused, state.reasons)
        if self._told is not None and self._told[:2] != told[:2]:
            log.info(
                "%s: database budget now %s%s",
                self.label,
                "paused" if state.paused else self.steps[state.level].describe(),
                f" ({'; '.join(state.reasons)})" if state.reasons else "",
            )
        self._told = told

    def _slot_reason(self, state: BudgetState) -> str:
        if state.causes and state.level < len(self.steps) - 1:
            return state.causes[0]
        return "slots"

    def _account(self, reason: str, seconds: float, *, waiting: bool = True) -> None:
        """``waiting``: a pause, or a wait for a slot while nothing moved, which counts towards
        ``give_up_after`` (a rest of the duty cycle does not: it is the budget working, not the purge held)."""
        self.pending[reason] = self.pending.get(reason, 0.0) + seconds
        if waiting:
            self.held_s += seconds


@contextmanager
def purge_session(conn: Any, ledger: Ledger, policy: RetentionPolicy) -> Iterator[None]:
    """Mark ``conn``'s session as a purge's (``PURGE_MARK``) while a chunk runs in it, from its first
    statement: the budget's observers do not count it as a foreground to yield to, even while it checks
    its ledger row or waits for the first baseline."""
    if not policy.budget.enabled:
        yield
        return
    ledger.mark(conn, True)
    try:
        yield
    finally:
        try:
            ledger.mark(conn, False)
        except Exception:
            log.debug("could not give back the purge mark", exc_info=True)


def _free_connections(signals: list[Signal], busy: int) -> float | None:
    """Connections free beyond the reserve, the purges' own batch slots counted as free."""
    for signal in signals:
        if signal.name == "connections" and signal.value is not None and signal.limit is not None:
            return signal.limit - signal.value + busy
    return None
