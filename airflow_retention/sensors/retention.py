"""``RetentionCompleteSensor``: a run is complete only when the ledger says every planned chunk is."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator

from airflow_retention import metrics
from airflow_retention.compat import AirflowFailException, AirflowSensorTimeout
from airflow_retention.core.cutoff import parse_cutoff
from airflow_retention.core.policy import RetentionPolicy, policy_to_dict
from airflow_retention.core.verify import MISSED_RUNS_WINDOW, missed_runs
from airflow_retention.hooks.retention import RetentionHook
from airflow_retention.operators.retention import RUN_XCOM_KEY, anchor_from_context, attempt_from_context
from airflow_retention.triggers.retention import RetentionCompleteTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

MISSED_RUNS_SHOWN = 5
# Task states after which a chunk task will not write to the ledger again (unless a person clears it).
_FINISHED = {"success", "failed", "skipped", "upstream_failed", "removed"}


class RetentionCompleteSensor(BaseSensorOperator):
    """Compare the run's expected chunk set with the ledger; mark the run complete when they match.

    Runs after the chunk tasks whatever their outcome (``trigger_rule="all_done"``) so it can report.
    While some chunk task may still write to the ledger it waits (``reschedule`` mode, or deferred to
    the triggerer with ``deferrable=True``); when none can (all finished, as after a failure or a chunk
    marked "success" by hand) or on timeout, it fails naming the chunk keys that are not complete.

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
        kwargs.setdefault("poke_interval", 30)
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
        if self.poke(context):
            return None
        run_key, expected = self._run(context)
        self.defer(
            trigger=RetentionCompleteTrigger(
                policy=policy_to_dict(self.policy),
                run_key=run_key,
                expected_keys=expected,
                poll_interval=float(self.poke_interval),
                timeout=float(self.timeout),
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=float(self.timeout) + 60),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> None:
        run_key, expected = self._run(context)
        if event.get("status") == "complete" and self.poke(context):
            return
        raise AirflowSensorTimeout(f"timed out after {self.timeout}s: {self.hook.verify(run_key, expected).describe()}")

    def poke(self, context: Context) -> bool:
        run_key, expected = self._run(context)
        verification = self.hook.verify(run_key, expected)
        if verification.ok:
            run = self.hook.complete_run(run_key, attempt_from_context(context).label())
            duration = (run["completed_at"] - run["planned_at"]).total_seconds() if run["completed_at"] else 0.0
            self.log.info(
                "run %s complete: %d chunk(s), %d row(s) %s, %.1f s since planning",
                run_key,
                run["chunks_completed"],
                run["rows_matched"] if self.policy.dry_run else run["rows_deleted"],
                "would be deleted (dry run)" if self.policy.dry_run else "deleted",
                duration,
            )
            self._report_leftovers(context, run_key)
            self._report_missed_runs(context)
            return True
        self.log.info("%s", verification.describe())
        if self.chunk_task_id and not self._chunks_in_flight(context):
            raise AirflowFailException(
                f"{verification.describe()}; no chunk task is still running, so nothing will complete them."
                " Clear the failed chunk task(s) (with downstream) to retry them."
            )
        return False

    def _report_leftovers(self, context: Context, run_key: str) -> None:
        """Measure the cleanup lag (the oldest eligible row left before the cutoff), store it on the run's
        ledger row and send it as a metric; a run that leaves eligible rows behind says so."""
        try:
            cutoff = parse_cutoff(self._info(context)["cutoff"])
            leftovers = self.hook.measure_leftovers(run_key, cutoff)
        except Exception:
            self.log.warning("could not measure the cleanup lag of run %s", run_key, exc_info=True)
            return
        metrics.cleanup_lag(self.policy, leftovers.lag_seconds, leftovers.count)
        if leftovers.count and not self.policy.dry_run:
            self.log.warning(
                "run %s: %s. Rows inserted or reopened with old timestamps after planning, or rows of chunks"
                " that failed, are left; the next run picks them up",
                run_key,
                leftovers.describe(cutoff),
            )
        else:
            self.log.info("run %s: %s", run_key, leftovers.describe(cutoff))

    def _report_missed_runs(self, context: Context) -> None:
        """Say in words which scheduled runs of the last 31 days never completed: days missed while the
        DAG was paused or the scheduler down, which only a backfill fills."""
        try:
            anchor = anchor_from_context(context)
            start = max(self.policy.start_date, anchor - MISSED_RUNS_WINDOW)
            with self.hook.open_connection() as conn:
                missed = missed_runs(conn, self.hook.ledger, self.policy, start, anchor - timedelta(microseconds=1))
        except Exception:
            self.log.warning("could not check the ledger for missed runs", exc_info=True)
            return
        if missed:
            shown = missed[-MISSED_RUNS_SHOWN:]
            self.log.warning(
                "policy %s: %d scheduled run(s) since %s are not complete in the ledger%s:\n%s",
                self.policy.name,
                len(missed),
                start.strftime("%Y-%m-%d"),
                f" (the {len(shown)} latest)" if len(shown) < len(missed) else "",
                "\n".join(m.describe(context["ti"].dag_id) for m in shown),
            )

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
