"""The archive table keeps every deleted row (issue 21, defect 6): an UNLOGGED archive, which a crash empties
while the deletions stay, is refused before anything is deleted; a batch whose archive received fewer rows
than it deleted (a trigger or a rule on the archive) is rolled back and fails permanently, naming the archive.
On both drivers, for plain batches, key chunks of one tenant and one-pass tenant batches."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CUTOFF, create_events, fill_events, ledger_chunks, make_policy, rows, scalar

SHAPES = {
    "key": {},
    "key-tenant": {"tenant_column": "tenant_id"},
    "block": {"chunk_by": "block", "key_column": None},
    "one-pass": {"chunk_by": "block", "key_column": None, "tenant_column": "tenant_id"},
}


def archived_events(admin: Any, schema: str, *, unlogged: bool = False) -> tuple[str, str]:
    table = create_events(admin, schema)
    fill_events(admin, table, 2_000, tenant="1 + mod(g, 4)")
    archive = f'"{schema}".archive'
    rows(admin, f"CREATE {'UNLOGGED ' if unlogged else ''}TABLE {archive} (LIKE {table})")
    return table, archive


def test_an_unlogged_archive_is_refused_before_anything_is_deleted(schema: str, conn: Any, admin: Any) -> None:
    table, archive = archived_events(admin, schema, unlogged=True)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    policy = make_policy(schema, archive_table=f"{schema}.archive")
    with pytest.raises(PermanentError, match=r"field 'archive_table': .*archive is UNLOGGED .*SET LOGGED"):
        plan_run(conn, policy, CUTOFF)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before
    rows(admin, f"ALTER TABLE {archive} SET LOGGED")
    plan = plan_run(conn, policy, CUTOFF)
    deleted = sum(run_chunk(conn, policy, plan.cutoff, c).rows_deleted for c in plan.chunks)
    assert deleted == scalar(admin, f"SELECT count(*) FROM {archive}") > 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_trigger_that_swallows_archived_rows_rolls_the_batch_back(
    schema: str, conn: Any, admin: Any, shape: str
) -> None:
    table, archive = archived_events(admin, schema)
    # A BEFORE INSERT trigger returning NULL drops the row silently: the INSERT reports fewer rows.
    rows(
        admin,
        f'CREATE FUNCTION "{schema}".swallow() RETURNS trigger LANGUAGE plpgsql AS'
        " $$ BEGIN IF mod(NEW.id, 5) = 0 THEN RETURN NULL; END IF; RETURN NEW; END $$",
    )
    rows(admin, f'CREATE TRIGGER swallow BEFORE INSERT ON {archive} FOR EACH ROW EXECUTE FUNCTION "{schema}".swallow()')
    snapshot = rows(admin, f"SELECT * FROM {table} ORDER BY id")
    policy = make_policy(schema, archive_table=f"{schema}.archive", **SHAPES[shape])
    plan = plan_run(conn, policy, CUTOFF)
    assert plan.chunks
    with pytest.raises(PermanentError, match=r"deleted \d+ row\(s\) but archive_table .*archive received \d+") as info:
        for chunk in plan.chunks:
            run_chunk(conn, policy, plan.cutoff, chunk)
    assert "rolled back" in str(info.value) and "trigger or rule" in str(info.value)
    assert rows(admin, f"SELECT * FROM {table} ORDER BY id") == snapshot
    assert scalar(admin, f"SELECT count(*) FROM {archive}") == 0
    assert sum(c["rows_deleted"] for c in ledger_chunks(admin, policy.ledger_schema, plan.run_key)) == 0
    # Once the archive keeps every row, the same chunks purge and archive them all.
    rows(admin, f"DROP TRIGGER swallow ON {archive}")
    deleted = sum(run_chunk(conn, policy, plan.cutoff, c).rows_deleted for c in plan.chunks)
    assert deleted == scalar(admin, f"SELECT count(*) FROM {archive}") > 0
