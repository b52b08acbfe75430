"""The metadata policies beside ``airflow db clean`` on identical data (issue 23): a metadata database
migrated by the installed Airflow (``airflow db migrate``), filled with a realistic mix
(``airflow_retention.demo.airflow_metadata``), cloned; ``airflow db clean --skip-archive`` in one copy,
the policies generated from the installed Airflow's cleanup configuration in the other, one after
another in ``db clean``'s order. Every row left must be the same, table by table. The same comparison
at 1M and 10M ``log`` rows is ``benchmarks/metadata_benchmark.py``."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg2
import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.demo import airflow_metadata as am
from airflow_retention.demo.postgres import admin_execute
from airflow_retention.metadata import MetadataSettings, metadata_policies
from tests.conftest import DSN
from tests.docs.markdown import REPO, Block, blocks

DOC = REPO / "docs" / "airflow-metadata.md"

ANCHOR = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
RUN_DATE = ANCHOR.replace(hour=0)
RETENTION_DAYS = 30


def run_both(tmp_path: Path, dsn: str, role: str | None = None) -> tuple[str, str]:
    """db clean in ``dsn``, the policies in a clone of it made first (as ``role``, with the grants of
    docs/airflow-metadata.md, when given); returns both DSNs."""
    ours = am.clone_database(dsn, f"{psycopg2.extensions.parse_dsn(dsn)['dbname']}_ours")
    cutoff = RUN_DATE - timedelta(days=RETENTION_DAYS)
    am.db_clean(tmp_path / "airflow", dsn, cutoff)
    policies = metadata_policies(
        MetadataSettings(conn_id="airflow_metadata", retention=f"{RETENTION_DAYS} days"), am.existing_tables(ours)
    )
    try:
        if role is not None:
            am.execute(ours, re.sub(r"\bretention_metadata\b", role, grants_block().text))
        am.run_policies(make_dsn(ours, user=role) if role else ours, policies, RUN_DATE)
    except BaseException:
        if role is not None:
            am.execute(ours, f'DROP OWNED BY "{role}" CASCADE')
        am.drop_database(ours)
        raise
    return dsn, ours


def grants_block() -> Block:
    (block,) = [b for b in blocks("sql", files=[DOC]) if "GRANT" in b.text]
    return block


@pytest.fixture
def role() -> Iterator[str]:
    """A role name of the test's own for docs/airflow-metadata.md's grants (created by them); dropped after."""
    name = f"retention_metadata_{uuid.uuid4().hex[:8]}"
    yield name
    admin_execute(DSN, f'DROP ROLE IF EXISTS "{name}"')


def test_the_policies_leave_exactly_the_rows_airflow_db_clean_leaves(
    tmp_path: Path, metadata_db: str, role: str
) -> None:
    """As the role docs/airflow-metadata.md creates, with exactly its grants."""
    seeded = am.seed_metadata(metadata_db, ANCHOR)
    theirs, ours = run_both(tmp_path, metadata_db, role)
    try:
        left = am.checksums(theirs, ANCHOR)
        assert am.checksums(ours, ANCHOR) == left
        after = am.table_counts(ours)
        # The comparison is not vacuous: both removed rows of every large table, and kept rows of each.
        for table in (
            "dag_run",
            "task_instance",
            "xcom",
            "log",
            "job",
            "task_instance_history",
            "dag_version",
            "trigger",
            "callback",
            "task_state_store",
        ):
            assert 0 < after[table] < seeded[table], (table, seeded[table], after[table])
        # db clean's rules hold: each DAG keeps its latest non-manual run, however old; NULL times stay.
        assert am.scalar(ours, "SELECT count(*) FROM log WHERE dttm IS NULL") == 1
        assert am.scalar(ours, "SELECT count(*) FROM dag WHERE dag_id = 'removed_dag'") == 0
        assert am.scalar(ours, "SELECT count(DISTINCT policy) FROM airflow_retention.runs") >= 15
    finally:
        am.execute(ours, f'DROP OWNED BY "{role}" CASCADE')
        am.drop_database(ours)


def test_the_docs_python_example_plans_in_a_metadata_database(metadata_db: str) -> None:
    """docs/airflow-metadata.md's Python example, as written: its policies plan against Airflow's tables."""
    from airflow_retention.core.planning.cutoff import freeze_cutoff
    from airflow_retention.core.planning.planner import compute_plan

    (block,) = [b for b in blocks("python", files=[DOC])]
    namespace: dict[str, object] = {"__name__": "docs_metadata_example"}
    exec(compile(block.text, block.where, "exec"), namespace)
    policies = namespace["policies"]
    assert isinstance(policies, list) and len(policies) >= 15
    assert namespace["dag"].dag_id == "metadata_purge"
    am.seed_metadata(metadata_db, ANCHOR, am.MetadataShape(dags=3, days=40, log_rows=500, job_rows=10))
    conn = psycopg2.connect(metadata_db)
    try:
        for policy in policies:
            preview = compute_plan(conn, policy, freeze_cutoff(policy, RUN_DATE), run_date=RUN_DATE)
            assert preview.rows_planned >= 0
        tenants = [p for p in policies if p.tenant_column == "dag_id"]
        assert tenants and all(dict(p.tenant_retention) for p in tenants)
    finally:
        conn.close()


def test_rows_of_a_run_still_running_are_kept_where_db_clean_deletes_them(tmp_path: Path, metadata_db: str) -> None:
    """The one deliberate difference: an old run still running (a stuck sensor, a run that never ended)
    and its task instances stay; db clean removes them."""
    am.seed_metadata(metadata_db, ANCHOR, am.MetadataShape(dags=3, days=60, log_rows=100, job_rows=10))
    old = RUN_DATE - timedelta(days=45)
    am.execute(
        metadata_db,
        "UPDATE dag_run SET state = 'running', end_date = NULL"
        " WHERE dag_id = 'dag_0001' AND logical_date::date = %(d)s",
        {"d": old.date()},
    )
    theirs, ours = run_both(tmp_path, metadata_db)
    try:
        running = "SELECT count(*) FROM dag_run WHERE dag_id = 'dag_0001' AND state = 'running' AND start_date < %(c)s"
        cutoff = {"c": RUN_DATE - timedelta(days=RETENTION_DAYS)}
        assert am.scalar(ours, running, cutoff) == 1
        assert am.scalar(theirs, running, cutoff) == 0
        for table in ("task_instance", "xcom", "task_instance_history"):
            of_run = (
                f"SELECT count(*) FROM {table} x JOIN dag_run r USING (dag_id, run_id)"
                " WHERE r.state = 'running' AND r.start_date < %(c)s"
            )
            kept, theirs_left = am.scalar(ours, of_run, cutoff), am.scalar(theirs, of_run, cutoff)
            assert (kept > 0 or table == "task_instance_history") and theirs_left == 0, (table, kept, theirs_left)
        # Everything else is as db clean left it: the tables whose rows of a running run are guarded aside.
        guarded = {"dag_run", "task_instance", "xcom", "task_instance_history", "task_reschedule", "task_state_store"}
        ours_sums, theirs_sums = am.checksums(ours, ANCHOR), am.checksums(theirs, ANCHOR)
        assert {t: v for t, v in ours_sums.items() if t not in guarded} == {
            t: v for t, v in theirs_sums.items() if t not in guarded
        }
    finally:
        am.drop_database(ours)


def test_the_command_reads_the_metadata_settings_file_like_a_policies_file(tmp_path: Path, metadata_db: str) -> None:
    """``airflow-retention --policies retention_airflow_metadata.yaml status``: every table's policy, its runs."""
    import json
    import subprocess
    import sys

    from airflow_retention.scaffold import METADATA_SETTINGS_FILE, source

    settings = tmp_path / METADATA_SETTINGS_FILE
    settings.write_text(
        source(METADATA_SETTINGS_FILE).replace("retention: 90 days", f"retention: {RETENTION_DAYS} days")
    )
    am.seed_metadata(metadata_db, ANCHOR, am.MetadataShape(dags=3, days=60, log_rows=500, job_rows=10))
    policies = metadata_policies(MetadataSettings(conn_id="airflow_metadata", retention=f"{RETENTION_DAYS} days"))
    am.run_policies(metadata_db, [p for p in policies if p.table.name in ("dag_run", "log")], RUN_DATE)
    cli = Path(sys.executable).with_name("airflow-retention")
    done = subprocess.run(
        [
            str(cli),
            "--policies",
            str(settings),
            "--dsn",
            metadata_db,
            "--json",
            "status",
            "airflow_dag_run",
            "airflow_log",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert "airflow_dag_run" in done.stdout and "airflow_log" in done.stdout, shown


def test_per_dag_retention_keeps_each_dags_rows_for_its_own_period_and_counts_them_per_dag(metadata_db: str) -> None:
    """``dag_retention``: dag_0001 a year, dag_0002 a week, the others the common 30 days; the ledger's
    ``tenant_counts`` holds each DAG's rows deleted; log rows without a DAG are purged at the common
    retention by the table's second policy (issue 32, item 5: they used to stay for good)."""
    am.seed_metadata(metadata_db, ANCHOR, am.MetadataShape(dags=4, days=90, log_rows=4_000, job_rows=10))
    settings = MetadataSettings(
        conn_id="airflow_metadata",
        retention=f"{RETENTION_DAYS} days",
        dag_retention={"dag_0001": "365 days", "dag_0002": "7 days"},
    )
    policies = {p.name: p for p in metadata_policies(settings, am.existing_tables(metadata_db))}
    assert policies["airflow_log"].tenant_column == "dag_id"
    assert policies["airflow_task_reschedule"].tenant_column is None  # its model has no dag_id
    assert policies["airflow_log_without_dag"].tenant_column is None
    assert policies["airflow_log_without_dag"].condition == '("log"."dag_id" IS NULL)'
    assert "airflow_task_reschedule_without_dag" not in policies  # its model has no dag_id
    assert "airflow_job_without_dag" in policies  # the scheduler's and triggerer's job rows
    assert "airflow_dag_run_without_dag" not in policies  # dag_run.dag_id is NOT NULL: nothing to remove
    nulls = am.scalar(metadata_db, "SELECT count(*) FROM log WHERE dag_id IS NULL")
    old_nulls = am.scalar(
        metadata_db,
        f"SELECT count(*) FROM log WHERE dag_id IS NULL AND dttm < %(d)s - interval '{RETENTION_DAYS} days'",
        {"d": RUN_DATE},
    )
    assert old_nulls > 0
    am.run_policies(
        metadata_db,
        [policies["airflow_dag_run"], policies["airflow_log"], policies["airflow_log_without_dag"]],
        RUN_DATE,
    )

    def oldest_days(dag_id: str, table: str = "log", column: str = "dttm") -> float:
        return float(
            am.scalar(
                metadata_db,
                f"SELECT extract(epoch FROM %(d)s - min({column})) / 86400 FROM {table} WHERE dag_id = %(g)s",
                {"d": RUN_DATE, "g": dag_id},
            )
        )

    assert oldest_days("dag_0001") > 60  # a year's retention: the 90 days stay
    assert oldest_days("dag_0002") <= 7
    assert 7 < oldest_days("dag_0000") <= RETENTION_DAYS
    assert am.scalar(metadata_db, "SELECT count(*) FROM log WHERE dag_id IS NULL") == nulls - old_nulls
    counted = dict(
        am.rows(
            metadata_db,
            "SELECT c.tenant, sum(c.rows_deleted)::bigint FROM airflow_retention.tenant_counts c"
            " JOIN airflow_retention.runs r USING (run_key) WHERE r.policy = 'airflow_log' GROUP BY c.tenant",
        )
    )
    assert counted.get("dag_0002", 0) > counted.get("dag_0000", 0) > 0 and counted.get("dag_0001", 0) == 0, counted
