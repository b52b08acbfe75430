"""Every grant list of the docs, as written: each ``sql`` block of README.md and docs/*.md that holds a
``GRANT`` is read from the Markdown, its role renamed to a role of the test's own, and run in a database
of the examples' tables; then a whole purge runs as that role, and nothing else: plan, every chunk, a
tenant left as a dead letter and its retry, verify, cleanup lag, completion, the next plan's pruning.
A grant the runtime needs and the docs do not list fails here (``permission denied for table …``).

A block that creates the role (docs/deployment.md) is a whole grant list. A block that only grants on
the ledger (docs/ledger.md) is run with the target-table grants of that whole list; where it grants on
the ledger's tables, an administrator creates the ledger first, as that page says.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.policy.loading import load_policies, policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers, measure_pending_lag, missed_runs, verify_run
from airflow_retention.demo.postgres import admin_execute
from tests.conftest import DSN, throwaway_database

from .conftest import RUN_DATE, admin_connection, seed
from .markdown import DOC_FILES, REPO, Block, blocks

POLICIES = REPO / "dags" / "retention_policies.yaml"
LEDGER_SCHEMA = "retention"  # the schema every grant list of the docs names


def grant_blocks() -> list[Block]:
    # docs/partman.md's grants need pg_partman: tests/partman/test_docs.py runs them, with a purge as that role;
    # docs/airflow-metadata.md's are for Airflow's tables: tests/metadata/test_side_by_side.py runs them.
    return [
        b
        for b in blocks("sql")
        if re.search(r"^\s*GRANT\b", b.text, re.I | re.M) and b.path.name not in ("partman.md", "airflow-metadata.md")
    ]


def statements(sql: str) -> list[str]:
    """The block's statements, comments removed (none of the docs' grant lists quotes a ';' or '--')."""
    text = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return [s.strip() for s in text.split(";") if s.strip()]


def roles_named(sql: str) -> set[str]:
    """The role names a grant list uses: the grantee of each GRANT, the role it creates or authorises."""
    found = set(re.findall(r"\bTO\s+([A-Za-z_]\w*)", sql, re.I))
    found |= set(re.findall(r"\b(?:CREATE\s+ROLE|AUTHORIZATION)\s+([A-Za-z_]\w*)", sql, re.I))
    return {r for r in found if r.upper() != "PUBLIC"}


def renamed(sql: str, role: str) -> str:
    for name in roles_named(sql):
        sql = re.sub(rf"\b{name}\b", role, sql)
    return sql


def creates_role(block: Block) -> bool:
    return re.search(r"\bCREATE\s+ROLE\b", block.text, re.I) is not None


def about_ledger(statement: str) -> bool:
    """A statement on the ledger's schema or its tables (the rest are the target tables' grants)."""
    return re.search(rf"\b(SCHEMA\s+{LEDGER_SCHEMA}\b|{LEDGER_SCHEMA}\.)", statement, re.I) is not None


def target_grants() -> list[str]:
    """The target-table part of the docs' whole grant lists (the ones that create the role)."""
    whole = [b for b in grant_blocks() if creates_role(b)]
    assert whole, "no grant list in the docs creates the purge role (docs/deployment.md did)"
    return [
        s for b in whole for s in statements(b.text) if not re.match(r"CREATE\s+ROLE", s, re.I) and not about_ledger(s)
    ]


def deletable_tables(grants: list[str]) -> set[str]:
    """The tables a grant list gives DELETE on, as written (``schema.table``)."""
    tables: set[str] = set()
    for statement in grants:
        match = re.match(r"GRANT\s+(.*?)\s+ON\s+(?:TABLE\s+)?(.*?)\s+TO\s+", statement, re.I | re.S)
        if match and "DELETE" in match[1].upper():
            tables |= {t.strip() for t in match[2].split(",")}
    return tables


@contextmanager
def purge_role(create: bool) -> Iterator[str]:
    """A role of the test's own (the docs' role names are replaced by it); dropped afterwards."""
    role = f"docs_purger_{uuid.uuid4().hex[:8]}"
    if create:
        admin_execute(DSN, f'CREATE ROLE "{role}" LOGIN')
    try:
        yield role
    finally:
        admin_execute(DSN, f'DROP ROLE IF EXISTS "{role}"')


def policies_for(tables: set[str]) -> list[RetentionPolicy]:
    """The example policies (dags/retention_policies.yaml) on the tables granted, and the same tenant
    table purged in one pass with a retention of one tenant's own: every ledger table gets written."""
    chosen = [p for p in load_policies(POLICIES) if str(p.table) in tables]
    events = next((p for p in chosen if p.tenant_column is not None), None)
    if events is not None:
        one_pass = {
            **policy_to_dict(events),
            "name": f"{events.name}_one_pass",
            "chunk_by": "block",
            "tenant_retention": {"2": "100 days"},
            "chunk_rows": 1_000,
            "batch_size": 500,
        }
        chosen.insert(0, RetentionPolicy.from_dict(one_pass))  # first: the key-chunk policy empties the table
    return chosen


def purge_as(dsn: str, admin: Any, policy: RetentionPolicy) -> None:
    """The whole life of a run, as the DAG's tasks do it, through the core API on the role's connection."""
    conn = psycopg2.connect(dsn)
    ledger = Ledger(policy.ledger_schema)
    try:
        cutoff = freeze_cutoff(policy, RUN_DATE)
        measure_pending_lag(conn, policy, ledger)  # the plan task's first step
        plan = plan_run(conn, policy, cutoff, run_date=RUN_DATE)
        assert plan.chunks, f"policy {policy.name}: nothing to purge in the examples' tables"
        refs = None
        if policy.chunk_by == "block" and policy.tenant_column is not None:
            # A tenant whose rows another table still references: a dead letter, recorded by this role.
            refs = f"public.refs_{policy.name}"
            key = policy.key_column
            with admin.cursor() as cur:
                cur.execute(f"CREATE TABLE {refs} (ref bigint REFERENCES {policy.table.sql} ({key}))")
                cur.execute(
                    f"INSERT INTO {refs} SELECT {key} FROM {policy.table.sql} WHERE tenant_id = 3"
                    f" AND {policy.timestamp_column} < %(c)s ORDER BY 1 LIMIT 3",
                    {"c": cutoff},
                )
        failed = []
        for chunk in plan.chunks:
            try:
                run_chunk(conn, policy, plan.cutoff, chunk)
            except PermanentError as exc:
                assert refs is not None and "tenant 3" in str(exc), str(exc)
                failed.append(chunk)
        keys = [c.key for c in plan.chunks]
        if refs is not None:
            assert failed, f"policy {policy.name}: no chunk met the referenced rows"
            assert not verify_run(conn, ledger, plan.run_key, keys).ok
            with admin.cursor() as cur:
                cur.execute(f"DROP TABLE {refs}")
            for chunk in failed:
                run_chunk(conn, policy, plan.cutoff, chunk)  # the retry resolves the dead letter
        verification = verify_run(conn, ledger, plan.run_key, keys)
        assert verification.ok, verification.describe()
        measure_leftovers(conn, policy, cutoff, ledger=ledger, run_key=plan.run_key, windowed=True)
        ledger.complete_run(conn, plan.run_key, "tests/docs/test_grants.py")
        missed_runs(conn, ledger, policy, RUN_DATE, RUN_DATE)
        conn.rollback()
    finally:
        conn.close()


@pytest.mark.parametrize("block", grant_blocks(), ids=lambda b: b.where)
def test_a_purge_runs_with_exactly_the_grants_the_docs_list(block: Block) -> None:
    own = creates_role(block)
    with purge_role(create=not own) as role, throwaway_database("retention_grants") as dsn:
        seed(dsn)
        admin = admin_connection(dsn)
        try:
            grants = statements(block.text)
            if not own:
                grants = target_grants() + grants
                if re.search(rf"\bON\s+(TABLE\s+)?{LEDGER_SCHEMA}\.", block.text, re.I):
                    # "with the ledger created by an administrator": the grants name its tables.
                    Ledger(LEDGER_SCHEMA).ensure(admin)
            with admin.cursor() as cur:
                for statement in grants:
                    try:
                        cur.execute(renamed(statement, role))
                    except psycopg2.Error as exc:
                        pytest.fail(f"{block.where}: {statement!r} fails: {exc}")
            tables = deletable_tables(grants)
            policies = policies_for(tables)
            assert policies, f"{block.where}: no example policy on the tables it grants ({tables})"
            assert any(p.archive_table is not None for p in policies)  # INSERT on the archive is tested too
            for policy in policies:
                assert policy.ledger_schema == LEDGER_SCHEMA
                try:
                    purge_as(make_dsn(dsn, user=role, password=None), admin, policy)
                except (PermanentError, psycopg2.Error) as exc:
                    pytest.fail(f"{block.where}: policy {policy.name} as a role with exactly these grants: {exc}")
        finally:
            admin.close()
            # The role owns the ledger schema where the docs give it to the role: gone with the database.


def inline_grants(parameter: str) -> list[tuple[str, str]]:
    """The one-statement grants the docs write in running text (`` `GRANT … ON PARAMETER x TO r;` ``),
    with where each is."""
    found = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for statement in re.findall(r"`(GRANT\s[^`]*?);?`", line):
                whole = re.search(r"\bTO\s+[A-Za-z_]\w*\s*$", statement)  # not "… TO <role>", not a name alone
                if whole and re.search(rf"\bON\s+PARAMETER\s+{parameter}\b", statement, re.I):
                    found.append((f"{path.relative_to(REPO)}:{number}", statement))
    return found


@pytest.mark.parametrize(("where", "grant"), inline_grants("wal_compression"), ids=lambda v: v)
def test_the_documented_wal_compression_grant_is_what_the_field_needs(where: str, grant: str) -> None:
    """docs/deployment.md: ``wal_compression: lz4`` needs ``GRANT SET ON PARAMETER wal_compression`` on
    top of the grant list. Without it the plan fails naming the field; with it the purge runs."""
    (whole,) = [b for b in grant_blocks() if creates_role(b)]
    with purge_role(create=False) as role, throwaway_database("retention_grants") as dsn:
        seed(dsn)
        admin = admin_connection(dsn)
        try:
            with admin.cursor() as cur:
                for statement in statements(whole.text):
                    cur.execute(renamed(statement, role))
            (audit,) = [p for p in load_policies(POLICIES) if p.archive_table is not None]
            policy = RetentionPolicy.from_dict({**policy_to_dict(audit), "wal_compression": "lz4"})
            role_dsn = make_dsn(dsn, user=role, password=None)
            conn = psycopg2.connect(role_dsn)
            try:
                with pytest.raises(PermanentError, match=r"field 'wal_compression'.*may not set wal_compression"):
                    plan_run(conn, policy, freeze_cutoff(policy, RUN_DATE), run_date=RUN_DATE)
            finally:
                conn.close()
            with admin.cursor() as cur:
                cur.execute(renamed(grant, role))
            purge_as(role_dsn, admin, policy)
        finally:
            admin.close()
            # A grant of the server, not of the database: revoked, or the role could not be dropped.
            admin_execute(
                DSN,
                f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN"
                f' REVOKE SET ON PARAMETER wal_compression FROM "{role}"; END IF; END $$',
            )


def test_the_docs_have_the_grant_lists_this_test_reads() -> None:
    """The extraction itself: a grant list the parser missed would not be tested at all."""
    files = {b.where.split(":")[0] for b in grant_blocks()}
    assert {"docs/deployment.md", "docs/ledger.md"} <= files, files
    assert len(grant_blocks()) >= 3
    assert "docs/deployment.md" in [w.split(":")[0] for w, _ in inline_grants("wal_compression")]
