"""``RetentionCompleteSensor``: a run is complete only when the ledger says every planned chunk is."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue

from airflow_retention import metrics
from airflow_retention.compat import AirflowFailException, AirflowSensorTimeout
from airflow_retention.core.errors import RetryableError
from airflow_retention.core.ledger.inflight import chunks_still_writing
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import format_cutoff, parse_cutoff
from airflow_retention.core.policy.loading import policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.slo import cleanup_slo
from airflow_retention.core.running.verify import (
    LAG_AT_VERIFY_TIMEOUT_MS,
    lag_left_to_next_run,
    missed_days,
    not_covered,
)
from airflow_retention.hooks.retention import RetentionHook
from airflow_retention.operators.context import anchor_from_context, attempt_from_context
from airflow_retention.operators.retention import RUN_XCOM_KEY, report_lag
from airflow_retention.triggers.retention import RetentionCompleteTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

MISSED_RUNS_SHOWN = 5
# Incomplete chunks named by their range in the verify task's failure message.
LABELS_SHOWN = 10
# Task states after which a chunk task will not write to the ledger again (unless a person clears it).
_FINISHED = {"success", "failed", "skipped", "upstream_failed", "removed"}
# While deferred, come back to the worker this often to look at the chunk tasks' states.
RECHECK_SECONDS = 60.0


class RetentionCompleteSensor(BaseSensorOperator):
    """Compare the run's expected chunk set with the ledger; mark the run complete when they match.

    Runs after the chunk tasks whatever their outcome (``trigger_rule="all_done"``) so it can report,
    including after a run with nothing eligible (whose mapped chunk task is skipped). It decides at its
    first look: every chunk task has ended by then, so the run is complete, or it fails naming the
    chunks that are not (as after a failed chunk, or one marked "success" by hand). It waits (in
    ``reschedule`` mode, or deferred to the triggerer with ``deferrable=True``) only while a chunk task
    is still in flight (when the sensor is wired to start earlier); for a chunk whose ledger row shows a
    batch less than a minute old although its task has ended (a zombie) it waits in its own process, a
    minute at most.

    :param policy: the retention policy.
    :param plan_task_id: task id of the planner whose ``run`` XCom (``run_key``, ``cutoff``,
        ``chunk_keys``) says what to verify.
    :param run_info: that mapping given directly instead (templated).
    :param chunk_task_id: task id of the mapped chunk task, to know whether any is still in flight.
    :param deferrable: wait in the triggerer instead of rescheduling.
    """

    template_fields: Sequence[str] = ("run_info",)
    ui_color = "#e6f4ea"

    def __init__(
        self,
        *,
        policy: RetentionPolicy,
        plan_task_id: str | None = None,
        run_info: Any = None,
        chunk_task_id: str | None = None,
        deferrable: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("mode", "reschedule")
        # Only a chunk that may still be written is waited for (see above), and it is near its end.
        kwargs.setdefault("poke_interval", 5)
        kwargs.setdefault("timeout", 6 * 3600)
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.policy = policy
        self.plan_task_id = plan_task_id
        self.run_info = run_info
        self.chunk_task_id = chunk_task_id
        self.deferrable = deferrable

    @cached_property
    def hook(self) -> RetentionHook:
        return RetentionHook(policy=self.policy)

    def _info(self, context: Context) -> Any:
        """The run to verify: ``run_info``, else the planner's ``run`` XCom."""
        if self.run_info is None and self.plan_task_id:
            return context["ti"].xcom_pull(task_ids=self.plan_task_id, key=RUN_XCOM_KEY)
        return self.run_info

    def _run(self, context: Context) -> tuple[str, list[str]]:
        info = self._info(context)
        if not isinstance(info, dict) or "run_key" not in info:
            raise AirflowFailException(
                f"policy {self.policy.name}: no plan to verify (the planner's 'run' XCom is {info!r});"
                " did the planner fail?"
            )
        keys = info.get("chunk_keys")
        if not isinstance(keys, list):
            raise AirflowFailException(f"policy {self.policy.name}: the plan {info!r} lists no chunk_keys")
        return info["run_key"], keys

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            try:
                return super().execute(context)
            except AirflowSensorTimeout:
                run_key, expected = self._run(context)
                raise AirflowSensorTimeout(
                    f"timed out after {self.timeout}s: {self.hook.verify(run_key, expected).describe()}"
                ) from None
        done = self.poke(context)
        if done:
            return done.xcom_value if isinstance(done, PokeReturnValue) else None
        self._defer(context, float(self.timeout))

    def _defer(self, context: Context, timeout: float) -> None:
        run_key, expected = self._run(context)
        self.defer(
            trigger=RetentionCompleteTrigger(
                policy=policy_to_dict(self.policy),
                run_key=run_key,
                expected_keys=expected,
                poll_interval=float(self.poke_interval),
                timeout=timeout,
                # The triggerer reads only the ledger: come back now and then to look at the chunk tasks,
                # so a chunk that failed in the meantime fails this task without waiting for the timeout.
                recheck_after=RECHECK_SECONDS,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout + 60),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        done = self.poke(context)
        if done:
            return done.xcom_value if isinstance(done, PokeReturnValue) else None
        if event.get("status") == "recheck":
            self._defer(context, float(event.get("remaining", self.timeout)))
            return None
        run_key, expected = self._run(context)
        raise AirflowSensorTimeout(f"timed out after {self.timeout}s: {self.hook.verify(run_key, expected).describe()}")

    def poke(self, context: Context) -> PokeReturnValue | bool:
        run_key, expected = self._run(context)
        verification = self.hook.verify(run_key, expected)
        if verification.ok:
            return PokeReturnValue(is_done=True, xcom_value=self._complete(context, run_key, expected))
        self.log.info("%s", verification.describe())
        if not self.chunk_task_id or self._chunks_in_flight(context):
            return False  # without chunk_task_id it cannot know that nothing will write: it waits
        if self._wait_out_zombies(run_key, expected):
            return PokeReturnValue(is_done=True, xcom_value=self._complete(context, run_key, expected))
        verification = self.hook.verify(run_key, expected)
        raise AirflowFailException(
            f"{verification.describe()}{self._incomplete_labels(run_key, expected)};"
            " no chunk task is still running, so nothing will complete them."
            " Clear the failed chunk task(s) (with downstream) to retry them."
        )

    def _wait_out_zombies(self, run_key: str, expected: list[str]) -> bool:
        """While a chunk whose task has ended still commits batches (its process lives on: a zombie), look
        at the ledger again every ``poke_interval``, in this process: such a chunk is still for a minute
        (``STILL_WRITING_WINDOW``) at most before it counts as stopped, too short to give up the worker
        slot for (and rescheduling itself fails on Task SDK 1.0.2). True once the run is complete."""
        deadline = time.monotonic() + float(self.timeout)
        while writing := self._chunks_still_writing(run_key, expected):
            if time.monotonic() > deadline:
                raise AirflowSensorTimeout(
                    f"timed out after {self.timeout}s waiting for chunks still written after their task ended:"
                    f" {self.hook.verify(run_key, expected).describe()}"
                )
            self.log.warning(
                "no chunk task is running, but chunk(s) %s committed a batch less than a minute ago: a process"
                " whose task ended (a zombie) may still be writing; looking again in %s s",
                ", ".join(c.label() for c in writing[:LABELS_SHOWN]),
                self.poke_interval,
            )
            time.sleep(float(self.poke_interval))
            if self.hook.verify(run_key, expected).ok:
                return True
        return False

    def _complete(self, context: Context, run_key: str, expected: list[str]) -> dict[str, Any]:
        """Mark the run complete, say what it did in one line, and return that (the task's XCom)."""
        run = self.hook.complete_run(run_key, attempt_from_context(context).label())
        cutoff = self._info(context).get("cutoff")
        duration = (run["completed_at"] - run["planned_at"]).total_seconds() if run["completed_at"] else 0.0
        rows = run["rows_matched"] if self.policy.dry_run else run["rows_deleted"]
        if not expected:
            outcome = f"nothing eligible at cutoff {cutoff}: 0 chunks"
        else:
            done = "would be deleted (dry run)" if self.policy.dry_run else "deleted"
            outcome = f"{run['chunks_completed']} chunk(s) complete, {rows:,} row(s) {done} at cutoff {cutoff}"
        deferred = list(run.get("leaves_deferred") or ())
        if deferred:
            # The run is done (its planned chunks are all it will do), yet it did not cover the table: never
            # a plain "complete", and a warning, so that a table outgrowing max_map_length is seen.
            outcome += f"; {not_covered(deferred, run['chunks_expected'])}"
        level = logging.WARNING if deferred else logging.INFO
        self.log.log(level, "run %s: %s; %.1f s since planning", run_key, outcome, duration)
        self._report_leftovers(context, run)
        self._report_missed_runs(context)
        self._report_slo()
        return {
            "run_key": run_key,
            "cutoff": cutoff,
            "outcome": outcome,
            "chunks": run["chunks_completed"],
            "rows_deleted": run["rows_deleted"],
            "rows_matched": run["rows_matched"],
            "leaves_deferred": deferred,
        }

    def _chunks_still_writing(self, run_key: str, expected: list[str]) -> list[ChunkSpec]:
        try:
            with self.hook.open_connection() as conn:
                return chunks_still_writing(conn, self.hook.ledger, run_key, expected)
        except Exception:
            self.log.warning("cannot read the ledger's chunk activity; not waiting for it", exc_info=True)
            return []

    def _incomplete_labels(self, run_key: str, expected: list[str]) -> str:
        """The incomplete chunks by the label their task shows in the UI, to find them there."""
        try:
            with self.hook.open_connection() as conn:
                rows = self.hook.ledger.chunk_rows(conn, run_key)
        except Exception:  # noqa: BLE001 - the message without labels still names the chunk keys
            return ""
        wanted = set(expected)
        labels = [ChunkSpec.of_row(r).label() for r in rows if r["chunk_key"] in wanted and r["state"] != "complete"]
        if not labels:
            return ""
        more = " …" if len(labels) > LABELS_SHOWN else ""
        return f" (in the UI: {', '.join(labels[:LABELS_SHOWN])}{more})"

    def _report_leftovers(self, context: Context, run: dict[str, Any]) -> None:
        """Measure the cleanup lag (the oldest eligible row left before the cutoff), store it on the run's
        ledger row and send it as a metric; a run that leaves eligible rows behind says so. After a large
        purge the walk would pass every row just deleted: the next run measures it when it plans."""
        run_key = run["run_key"]
        why_later = lag_left_to_next_run(run)
        if why_later is not None:
            self.log.info("run %s: cleanup lag left to the next run's planning: %s", run_key, why_later)
            return
        try:
            cutoff = parse_cutoff(self._info(context)["cutoff"])
            leftovers = self.hook.measure_leftovers(run_key, cutoff, timeout_ms=LAG_AT_VERIFY_TIMEOUT_MS)
        except RetryableError as exc:
            if exc.sqlstate != "57014":
                self.log.warning("could not measure the cleanup lag of run %s", run_key, exc_info=True)
                return
            self.log.info(
                "run %s: measuring the cleanup lag took over %d ms; the next run measures it when it plans",
                run_key,
                LAG_AT_VERIFY_TIMEOUT_MS,
            )
            return
        except Exception:
            self.log.warning("could not measure the cleanup lag of run %s", run_key, exc_info=True)
            return
        report_lag(self.log, self.policy, run_key, cutoff, leftovers)

    def _report_missed_runs(self, context: Context) -> None:
        """Say in words which scheduled runs of the window before this run never completed (days missed
        while the DAG was paused or the scheduler down): those a backfill could still delete rows for, and,
        apart, those a later complete run has covered (nothing left for them)."""
        try:
            anchor = anchor_from_context(context)
            with self.hook.open_connection() as conn:
                days = missed_days(conn, self.hook.ledger, self.policy, anchor)
        except Exception:
            self.log.warning("could not check the ledger for missed runs", exc_info=True)
            return
        if days.missed:
            shown = days.missed[-MISSED_RUNS_SHOWN:]
            self.log.warning(
                "policy %s: %d scheduled run(s) after %s are not complete in the ledger and could still delete"
                " rows%s:\n%s",
                self.policy.name,
                len(days.missed),
                days.since.strftime("%Y-%m-%d"),
                f" (the {len(shown)} latest)" if len(shown) < len(days.missed) else "",
                "\n".join(m.describe(context["ti"].dag_id) for m in shown),
            )
        if days.covered:
            cover = days.latest_cover
            self.log.info(
                "policy %s: %d scheduled run(s) after %s have no complete run of their own, but the complete"
                " run with cutoff %s already deleted what they would: no backfill needed (%s to %s)",
                self.policy.name,
                len(days.covered),
                days.since.strftime("%Y-%m-%d"),
                format_cutoff(cover) if cover is not None else "?",
                days.covered[0].anchor.strftime("%Y-%m-%d"),
                days.covered[-1].anchor.strftime("%Y-%m-%d"),
            )

    def _report_slo(self) -> None:
        """The cleanup SLO as the ledger's history tells it now that this run is complete (after its cleanup
        lag: the backlog is fresh), in one line, and its warnings (at risk, an exhausted database budget) at
        WARNING; the budget's state and the SLO as metrics."""
        try:
            with self.hook.open_connection() as conn:
                slo = cleanup_slo(conn, self.policy, self.hook.ledger)
                state = self.hook.ledger.budget_snapshot(conn)
        except Exception:
            self.log.warning("could not compute the cleanup SLO of policy %s", self.policy.name, exc_info=True)
            return
        if state is not None:
            metrics.budget(self.policy, concurrency=state["concurrency"], duty=state["duty"], paused=state["paused"])
        if slo is None:
            return
        metrics.slo(self.policy, slo)
        self.log.log(logging.WARNING if slo.warnings else logging.INFO, "policy %s: %s", self.policy.name,
                     slo.describe())  # fmt: skip
        for warning in slo.warnings:
            self.log.warning("policy %s: %s", self.policy.name, warning)

    def _chunks_in_flight(self, context: Context) -> bool:
        ti = context["ti"]
        try:
            states = ti.get_task_states(dag_id=ti.dag_id, task_ids=[self.chunk_task_id], run_ids=[ti.run_id])
        except Exception:
            self.log.warning("cannot read chunk task states; waiting for the ledger instead", exc_info=True)
            return True
        per_run = states.get(ti.run_id, {}) if isinstance(states, dict) else {}
        unfinished = [k for k, state in per_run.items() if str(state) not in _FINISHED]
        if unfinished:
            self.log.info("chunk task(s) still in flight: %s", ", ".join(sorted(unfinished)[:10]))
        return bool(unfinished)
