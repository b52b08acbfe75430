"""Retention DAGs run by a real Airflow 3 (``dag.test()``) against the real PostgreSQL: the tables and
the ledger afterwards."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

import psycopg2
import pytest

from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import format_cutoff, freeze_cutoff, run_key
from airflow_retention.core.policy.loading import load_policies
from tests.conftest import POLICIES_FILE
from tests.provider.conftest import TEST_POLICIES, load_dag, query, resume, task_instances, utc, xcom_values

pytestmark = pytest.mark.airflow

LEDGER = Ledger("airflow_t_ledger")


def orders_policy() -> Any:
    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_orders")
    return policy


def ledger_run(conn: Any, day: str, policy: Any = None) -> dict[str, Any] | None:
    policy = policy or orders_policy()
    return Ledger(policy.ledger_schema).get_run(conn, run_key(policy, freeze_cutoff(policy, utc(day))))


def eligible(conn: Any, day: str) -> int:
    cutoff = freeze_cutoff(orders_policy(), utc(day))
    return query(conn, "SELECT count(*) FROM airflow_t.orders WHERE created_at < %s AND status <> 'open'", (cutoff,))[
        0
    ][0]


def kept(conn: Any, day: str) -> list[tuple[Any, ...]]:
    """Ids of the rows a lone run of ``day`` must leave."""
    cutoff = freeze_cutoff(orders_policy(), utc(day))
    return query(
        conn,
        "SELECT array_agg(id ORDER BY id) FROM airflow_t.orders WHERE NOT (created_at < %s AND status <> 'open')",
        (cutoff,),
    )


def test_every_example_dag_end_to_end(target: Any) -> None:
    from airflow_retention.demo.seed import Shape, seed_examples, snapshot

    policies = load_policies(POLICIES_FILE)
    day = "2026-06-05"
    cutoffs = {p.name: freeze_cutoff(p, utc(day)) for p in policies}
    seed_examples(target, utc("2026-06-10"), {n: [c] for n, c in cutoffs.items()}, Shape(20_000, 40_000, 10_000))
    before = {p.name: snapshot(target, p, cutoffs[p.name]) for p in policies}
    for policy in policies:
        assert before[policy.name].eligible > 0
        dag_run = load_dag(f"retention_{policy.name}").test(logical_date=utc(day))
        assert dag_run.state == "success"
        after = snapshot(target, policy, cutoffs[policy.name])
        assert after.eligible == 0
        assert (after.total, after.keep_checksum) == (before[policy.name].keep_count, before[policy.name].keep_checksum)
        run = Ledger(policy.ledger_schema).get_run(target, run_key(policy, cutoffs[policy.name]))
        assert run is not None and run["state"] == "complete"
        assert run["rows_deleted"] == before[policy.name].eligible
        assert run["chunks_completed"] == run["chunks_expected"] >= 1
        if policy.archive_table is not None:
            assert query(target, f"SELECT count(*) FROM {policy.archive_table.sql}")[0][0] == run["rows_deleted"]
        labels = [ti.rendered_map_index for ti in task_instances(dag_run) if ti.task_id.endswith("purge_chunk")]
        unit = "blocks " if policy.chunk_by == "block" else "ids "
        assert labels and all(unit in label or label.startswith(("drop ", "detach ")) for label in labels)
        # Once it ran, a chunk's label says what it did.
        assert all(re.search(r" · [\d,]+ deleted(, [\d,]+ archived)?$", label) for label in labels), labels
        if policy.expired_partitions == "drop":
            assert any(label.startswith("drop api_requests_") for label in labels)
        if policy.tenant_column:
            assert any(label.startswith("tenant") or "tenants" in label for label in labels)


def test_a_partitioned_table_drops_whole_months_and_purges_the_straddling_one(target: Any) -> None:
    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_parts")
    cutoff = freeze_cutoff(policy, utc("2026-04-15"))  # 2026-04-05: January to March wholly expired
    per_month = {m: query(target, f"SELECT count(*) FROM airflow_t.{m}")[0][0] for m in ("m01", "m02", "m03")}
    april = query(target, "SELECT count(*) FROM airflow_t.parts WHERE created_at < %s", (cutoff,))[0][0]
    april -= sum(per_month.values())
    dag_run = load_dag("retention_t_parts").test(logical_date=utc("2026-04-15"))
    assert dag_run.state == "success"
    left = {r[0] for r in query(target, "SELECT relname FROM pg_partition_tree('airflow_t.parts') t"
                                        " JOIN pg_class c ON c.oid = t.relid WHERE t.level = 1")}  # fmt: skip
    assert left == {"m04", "m05"}
    assert query(target, "SELECT count(*) FROM airflow_t.parts WHERE created_at < %s", (cutoff,))[0][0] == 0
    run = Ledger(policy.ledger_schema).get_run(target, run_key(policy, cutoff))
    assert run["state"] == "complete" and run["rows_deleted"] == sum(per_month.values()) + april
    chunks = {c["chunk_key"]: c for c in Ledger(policy.ledger_schema).chunk_rows(target, run["run_key"])}
    for month, count in per_month.items():
        assert (chunks[f"drop:airflow_t.{month}"]["outcome"], chunks[f"drop:airflow_t.{month}"]["rows_deleted"]) == (
            "dropped",
            count,
        )
    labels = sorted(ti.rendered_map_index for ti in task_instances(dag_run) if ti.task_id.endswith("purge_chunk"))
    assert labels[:3] == [f"drop {m} · {n:,} deleted" for m, n in per_month.items()]
    assert all(label.startswith("m04 · blocks ") for label in labels[3:]) and labels[3:]
    assert sum(int(label.split(" · ")[-1].removesuffix(" deleted").replace(",", "")) for label in labels[3:]) == april


def test_a_uuid_keyed_table_with_names_that_need_quoting(target: Any) -> None:
    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_odd")
    assert policy.key_column is None and policy.chunk_by == "block"
    cutoff = freeze_cutoff(policy, utc("2026-03-01"))
    count = 'SELECT count(*) FROM airflow_t."Uuid Events; x" WHERE "Created At" < %s'
    eligible_before = query(target, count, (cutoff,))[0][0]
    total = query(target, 'SELECT count(*) FROM airflow_t."Uuid Events; x"')[0][0]
    assert load_dag("retention_t_odd").test(logical_date=utc("2026-03-01")).state == "success"
    assert query(target, count, (cutoff,))[0][0] == 0
    assert query(target, 'SELECT count(*) FROM airflow_t."Uuid Events; x"')[0][0] == total - eligible_before > 0
    run = Ledger(policy.ledger_schema).get_run(target, run_key(policy, cutoff))
    assert run["rows_deleted"] == eligible_before and run["target_table"] == 'airflow_t."Uuid Events; x"'


def test_backfill_in_any_order_leaves_what_a_lone_latest_run_leaves(target: Any) -> None:
    expected = kept(target, "2026-02-10")
    dag = load_dag("retention_t_orders")
    for day in ("2026-02-10", "2026-02-01", "2026-02-05"):
        assert dag.test(logical_date=utc(day)).state == "success"
    assert kept(target, "2026-02-10") == expected
    assert query(target, "SELECT array_agg(id ORDER BY id) FROM airflow_t.orders") == expected
    assert eligible(target, "2026-02-10") == 0
    runs = {day: ledger_run(target, day) for day in ("2026-02-01", "2026-02-05", "2026-02-10")}
    assert all(run is not None and run["state"] == "complete" for run in runs.values())
    # Earlier cutoffs find their rows already gone: complete, with nothing to do.
    assert runs["2026-02-10"]["rows_deleted"] > 0
    assert runs["2026-02-01"]["rows_deleted"] == runs["2026-02-05"]["rows_deleted"] == 0


def test_rerunning_a_completed_run_deletes_nothing_and_keeps_one_completion(target: Any) -> None:
    dag = load_dag("retention_t_orders")
    first = dag.test(logical_date=utc("2026-02-05"))
    assert first.state == "success"
    key = ledger_run(target, "2026-02-05")["run_key"]
    chunks_before = LEDGER.chunk_rows(target, key)
    assert len(chunks_before) > 3
    rows_before = query(target, "SELECT count(*) FROM airflow_t.orders")[0][0]
    query(target, "INSERT INTO airflow_t.orders VALUES (999999, 1, '2026-01-02', 'closed') RETURNING id")

    second = dag.test(logical_date=utc("2026-02-05"))
    assert second.state == "success"
    # The stored plan is reused: the late row (eligible, but not planned) is left for the next run.
    assert query(target, "SELECT count(*) FROM airflow_t.orders")[0][0] == rows_before + 1
    chunks_after = LEDGER.chunk_rows(target, key)
    assert [(c["chunk_key"], c["completed_at"], c["completed_run_id"], c["rows_deleted"]) for c in chunks_after] == [
        (c["chunk_key"], c["completed_at"], c["completed_run_id"], c["rows_deleted"]) for c in chunks_before
    ]
    summaries = xcom_values(second, "retention_t_orders.purge_chunk")
    assert len(summaries) == len(chunks_before)
    assert all(s["already_complete"] and s["rows_deleted"] == 0 for s in summaries)
    assert ledger_run(target, "2026-02-05")["rows_deleted"] == sum(c["rows_deleted"] for c in chunks_before)


def test_a_failed_chunk_cleared_alone_reruns_alone_and_the_run_completes(
    target: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    import psycopg2

    from tests.conftest import E2E_DSN

    dag = load_dag("retention_t_orders")
    locker = psycopg2.connect(E2E_DSN)
    try:
        with locker.cursor() as cur:  # hold a lock on one eligible row of tenant 5 for the first attempt
            cur.execute(
                "SELECT id FROM airflow_t.orders WHERE tenant_id = 5 AND created_at < '2026-01-20' AND status <> 'open'"
                " ORDER BY id LIMIT 1 FOR UPDATE"
            )
            (locked_id,) = cur.fetchone()
        failed_run = dag.test(logical_date=utc("2026-02-05"))
    finally:
        locker.rollback()
        locker.close()
    assert failed_run.state == "failed"
    tis = task_instances(failed_run)
    failed = [ti for ti in tis if ti.state == "failed" and ti.task_id.endswith("purge_chunk")]
    assert len(failed) == 1
    verify = next(ti for ti in tis if ti.task_id.endswith("verify"))
    assert verify.state == "failed"
    key = ledger_run(target, "2026-02-05")["run_key"]
    chunks = {c["chunk_key"]: c for c in LEDGER.chunk_rows(target, key)}
    incomplete = [k for k, c in chunks.items() if c["state"] != "complete"]
    assert len(incomplete) == 1 and "lock timeout" in (chunks[incomplete[0]]["last_error"] or "")
    out = " ".join(capfd.readouterr().out.split())  # Airflow 3.0's console log wraps long exception messages
    assert incomplete[0] in out  # the sensor named the missing chunk by its ledger key
    assert query(target, "SELECT count(*) FROM airflow_t.orders WHERE id = %s", (locked_id,))[0][0] == 1
    # The failed chunk's label still names its range (the UI's way to find it), without a result.
    failed_range = ChunkSpec.of_row(chunks[incomplete[0]]).label()
    assert failed[0].rendered_map_index == failed_range
    assert f"(in the UI: {failed_range})" in out  # and by the label its task shows

    done_before = {k: (c["completed_at"], c["attempts"]) for k, c in chunks.items() if c["state"] == "complete"}
    failed_index = failed[0].map_index
    finished = resume(
        dag,
        failed_run,
        lambda ti: (
            (ti.task_id.endswith("purge_chunk") and ti.map_index == failed_index) or ti.task_id.endswith("verify")
        ),
    )
    assert finished.state == "success"
    after = {c["chunk_key"]: c for c in LEDGER.chunk_rows(target, key)}
    assert all(c["state"] == "complete" for c in after.values())
    assert {k: (after[k]["completed_at"], after[k]["attempts"]) for k in done_before} == done_before
    assert after[incomplete[0]]["completed_try_number"] == 2
    retried = next(
        ti for ti in task_instances(finished) if ti.task_id.endswith("purge_chunk") and ti.map_index == failed_index
    )
    # The retry's label: the range and the chunk's rows over both tries (the first deleted some, then failed).
    assert re.fullmatch(
        rf"{re.escape(failed_range)} · {after[incomplete[0]]['rows_deleted']:,} deleted \([\d,]+ on this try\)",
        retried.rendered_map_index,
    ), retried.rendered_map_index
    assert ledger_run(target, "2026-02-05")["state"] == "complete"
    assert eligible(target, "2026-02-05") == 0


def test_a_chunk_marked_success_without_running_is_caught(target: Any, capfd: pytest.CaptureFixture[str]) -> None:
    dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-02-05"), mark_success_pattern=r".*purge_chunk")
    assert dag_run.state == "failed"
    verify = next(ti for ti in task_instances(dag_run) if ti.task_id.endswith("verify"))
    assert verify.state == "failed"
    run = ledger_run(target, "2026-02-05")
    assert run["state"] == "planned"
    pending = [c["chunk_key"] for c in LEDGER.chunk_rows(target, run["run_key"])]
    out = " ".join(capfd.readouterr().out.split())  # Airflow 3.0's console log wraps long exception messages
    assert f"0 of {len(pending)} expected chunk(s) complete" in out
    assert pending[0] in out
    assert eligible(target, "2026-02-05") > 0


def test_nothing_eligible_ends_green_with_the_run_recorded(target: Any) -> None:
    dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-01-05"))
    assert dag_run.state == "success"
    run = ledger_run(target, "2026-01-05")
    assert run["state"] == "complete"
    assert (run["chunks_expected"], run["rows_deleted"]) == (0, 0)
    # The empty mapped task is skipped; verify still runs, and says why there was nothing to do.
    states = {ti.task_id: ti.state for ti in task_instances(dag_run)}
    assert states["retention_t_orders.purge_chunk"] == "skipped"
    assert states["retention_t_orders.verify"] == "success"
    said = f"nothing eligible at cutoff {format_cutoff(run['cutoff'])}: 0 chunks"
    (verify,) = xcom_values(dag_run, "retention_t_orders.verify")
    assert verify["outcome"] == said  # the verify task's XCom, on its page in the UI


def test_verify_decides_at_its_first_look_and_labels_show_each_chunks_result(target: Any) -> None:
    dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-02-05"))
    assert dag_run.state == "success"
    tis = task_instances(dag_run)
    verify = next(ti for ti in tis if ti.task_id.endswith("verify"))
    assert (verify.state, reschedules(verify)) == ("success", 0)  # no poke interval waited
    chunks = [ti for ti in tis if ti.task_id.endswith("purge_chunk")]
    rows = {c["completed_map_index"]: c for c in LEDGER.chunk_rows(target, ledger_run(target, "2026-02-05")["run_key"])}
    assert len(chunks) == len(rows) > 1
    for ti in chunks:
        row = rows[ti.map_index]
        assert ti.rendered_map_index == f"{ChunkSpec.of_row(row).label()} · {row['rows_deleted']:,} deleted"


def test_verify_waits_only_for_a_chunk_still_written_after_its_task_ended(
    target: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """Chunk tasks marked "success" while a process (a zombie) still writes their chunks: verify waits for
    it instead of failing, and completes the run once the ledger shows the chunks complete."""
    from airflow_retention.core.running.engine import run_chunk
    from tests.conftest import E2E_DSN

    policy = orders_policy()
    cutoff = freeze_cutoff(policy, utc("2026-02-05"))
    key = run_key(policy, cutoff)
    done = threading.Event()
    failures: list[BaseException] = []

    def zombie() -> None:
        conn = psycopg2.connect(E2E_DSN)
        conn.autocommit = True
        try:
            deadline = time.monotonic() + 60
            while (
                not query(conn, "SELECT to_regclass('airflow_t_ledger.chunks') IS NOT NULL")[0][0]
                or not query(conn, "SELECT count(*) FROM airflow_t_ledger.chunks WHERE run_key = %s", (key,))[0][0]
            ):
                assert time.monotonic() < deadline, "the plan never reached the ledger"
                time.sleep(0.05)
            for _ in range(8):  # a batch a second for 8 s, as a live chunk process leaves it
                query(
                    conn,
                    "UPDATE airflow_t_ledger.chunks SET state = 'running', last_batch_at = clock_timestamp()"
                    " WHERE run_key = %s RETURNING 1",
                    (key,),
                )
                time.sleep(1)
            for chunk in LEDGER.stored_plan(conn, key):
                run_chunk(conn, policy, cutoff, chunk)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            conn.close()
            done.set()

    writer = threading.Thread(target=zombie, daemon=True)
    writer.start()
    dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-02-05"), mark_success_pattern=r".*purge_chunk")
    done.wait(60)
    assert not failures, failures
    assert dag_run.state == "success"
    verify = next(ti for ti in task_instances(dag_run) if ti.task_id.endswith("verify"))
    # It waited in its own process (a minute at most), not by rescheduling itself.
    assert verify.state == "success" and reschedules(verify) == 0
    assert "may still be writing" in capfd.readouterr().out
    assert ledger_run(target, "2026-02-05")["state"] == "complete"
    assert eligible(target, "2026-02-05") == 0


def reschedules(ti: Any) -> int:
    """How many times a sensor's task instance was rescheduled (poked again later)."""
    from airflow import settings
    from airflow.models.taskreschedule import TaskReschedule
    from sqlalchemy import func, select

    return settings.Session().scalar(select(func.count()).where(TaskReschedule.ti_id == ti.id))


def test_chunk_count_never_exceeds_max_map_length(target: Any) -> None:
    os.environ["AIRFLOW__CORE__MAX_MAP_LENGTH"] = "3"
    try:
        dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-02-25"))
    finally:
        del os.environ["AIRFLOW__CORE__MAX_MAP_LENGTH"]
    assert dag_run.state == "success"
    run = ledger_run(target, "2026-02-25")
    assert 1 <= run["chunks_expected"] <= 3
    assert run["chunk_rows"] > orders_policy().chunk_rows  # grew instead of exceeding the limit
    assert run["state"] == "complete" and eligible(target, "2026-02-25") == 0


def test_a_manual_run_without_logical_date_freezes_its_run_after(target: Any) -> None:
    run_after = utc("2026-02-07")
    dag_run = load_dag("retention_t_orders").test(logical_date=None, run_after=run_after)
    assert dag_run.state == "success"
    run = ledger_run(target, "2026-02-07")
    assert run is not None and run["state"] == "complete"


def test_task_group_and_lone_chunk_reused_in_another_dag(target: Any) -> None:
    dag_run = load_dag("reuse_pipeline").test(logical_date=utc("2026-02-05"))
    assert dag_run.state == "success"
    states = {ti.task_id: ti.state for ti in task_instances(dag_run)}
    assert states["retention_reuse_orders.verify"] == "success"
    assert states["lone_chunk"] == states["report"] == "success"
    assert eligible(target, "2026-02-05") == 0
    assert query(target, "SELECT count(*) FROM airflow_t.audit WHERE at < '2026-02-04'")[0][0] == 0
    assert query(target, "SELECT count(*) FROM airflow_t.audit")[0][0] > 0


def test_the_sensor_fails_naming_a_chunk_whose_ledger_row_is_missing(
    target: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    dag = load_dag("retention_t_orders")
    dag_run = dag.test(logical_date=utc("2026-02-05"))
    assert dag_run.state == "success"
    key = ledger_run(target, "2026-02-05")["run_key"]
    lost = LEDGER.chunk_rows(target, key)[1]["chunk_key"]
    query(target, "DELETE FROM airflow_t_ledger.chunks WHERE chunk_key = %s RETURNING 1", (lost,))
    capfd.readouterr()

    rerun = resume(dag, dag_run, lambda ti: ti.task_id.endswith("verify"))
    assert rerun.state == "failed"
    assert f"missing: {lost} (no ledger row)" in capfd.readouterr().out


def test_a_runs_conf_never_reaches_sql(target: Any) -> None:
    hostile = {
        "table": "airflow_t.orders; DROP TABLE airflow_t.audit; --",
        "cutoff": "2999-01-01T00:00:00Z') OR (true",
        "condition": "true) OR (true",
        "dry_run": True,
    }
    dag_run = load_dag("retention_t_orders").test(logical_date=utc("2026-02-05"), run_conf=hostile)
    assert dag_run.state == "success"
    assert query(target, "SELECT count(*) FROM airflow_t.audit")[0][0] == 500  # not dropped
    assert eligible(target, "2026-02-05") == 0  # the run's own cutoff, not the conf's
    assert query(target, "SELECT count(*) FROM airflow_t.orders WHERE created_at >= '2026-01-26'")[0][0] > 0
    assert query(target, "SELECT count(*) FROM airflow_t.orders WHERE status = 'open'")[0][0] > 0


def test_a_failed_plan_is_in_the_ledger_and_status_calls_the_policy_failing(target: Any) -> None:
    """A plan that fails once the ledger exists (here: a run date whose cutoff is in the future) leaves no
    run row; the hook records it in plan_failures, and `status` (the view's numbers too) says the policy
    is failing, with the plan's own message."""
    from airflow_retention.cli.report import policy_status

    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_audit_dry")
    dag_run = load_dag("retention_t_audit_dry").test(logical_date=utc("2999-01-01"))
    assert dag_run.state == "failed"
    key = run_key(policy, freeze_cutoff(policy, utc("2999-01-01")))
    failure = Ledger(policy.ledger_schema).latest_plan_failure(target, policy.name)
    assert failure is not None and failure["run_key"] == key
    assert "in the future" in failure["error"] and failure["failed_by"].startswith("retention_t_audit_dry/")
    status = policy_status(target, policy, limit=5)
    (failing,) = status.failures
    assert failing.kind == "plan_failed" and failing.run_key == key
    assert f"run {key}: its plan failed at" in failing.message and "in the future" in failing.message


@pytest.mark.solo
def test_a_problem_no_retry_can_fix_fails_at_once_and_deletes_nothing(target: Any) -> None:
    rows_before = query(target, "SELECT count(*) FROM airflow_t.orders")[0][0]
    started = time.monotonic()
    dag_run = load_dag("retention_t_missing").test(logical_date=utc("2026-02-05"))
    assert dag_run.state == "failed"
    plan = next(ti for ti in task_instances(dag_run) if ti.task_id.endswith(".plan"))
    assert (plan.state, plan.try_number, plan.max_tries) == ("failed", 1, 3)  # three retries allowed, none used
    assert time.monotonic() - started < 30  # no retry delay was waited
    assert query(target, "SELECT count(*) FROM airflow_t.orders")[0][0] == rows_before
