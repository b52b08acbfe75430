"""Issue 21, defect 7 (the audit gaps), on both drivers: duplicate tenants of ``tenant_retention_table``
get their longest retention, a policy that lost its ``tenant_column`` cannot bypass the run's frozen
per-tenant cutoffs, and ``verify`` tells a missing chunk from a complete chunk that left a dead letter."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers, verify_run
from tests.core.helpers import CUTOFF, ledger_chunk, make_policy, rows, scalar
from tests.core.tenant_helpers import ANCHOR, interleaved, ledger_tenant_counts, one_pass, per_tenant_eligible


def test_duplicate_tenants_of_the_lookup_table_get_their_longest_retention(
    schema: str, conn: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    table = interleaved(admin, schema, 4_000)
    # No unique index: tenant 4 is listed three times, its shortest retention last in the heap (the
    # order a sequential scan returns), tenant 5 twice with the same cutoff written two ways.
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id integer, retention interval)')
    rows(
        admin,
        f"""INSERT INTO "{schema}".keep VALUES (4, '365 days'), (5, '60 days'), (4, '60 days'),"""
        """ (5, '1440:00:00'), (4, '10 days')""",
    )
    assert [r[0] for r in rows(admin, f'SELECT retention::text FROM "{schema}".keep WHERE tenant_id = 4')][-1] == (
        "10 days"
    )
    policy = one_pass(schema, tenant_retention_table=f"{schema}.keep")
    with caplog.at_level(logging.WARNING, logger="airflow_retention"):
        plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    frozen = {t: (r, c) for t, r, c, _ in Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)}
    assert frozen["4"] == ("365 days", ANCHOR - timedelta(days=365))
    assert frozen["5"][1] == ANCHOR - timedelta(days=60)
    assert frozen["5"][0] == "1440:00:00"  # a tie: the first in text order, the same on every run
    warned = [r.getMessage() for r in caplog.records if "tenant_retention_table" in r.getMessage()]
    assert any("tenant '4' 3 times" in m and "10 days, 365 days, 60 days" in m for m in warned), warned
    assert any("tenant '5' 2 times" in m for m in warned), warned
    own = {"4": ANCHOR - timedelta(days=365), "5": ANCHOR - timedelta(days=60)}
    expected = per_tenant_eligible(admin, table, own)
    assert "4" not in expected and per_tenant_eligible(admin, table)["4"] > 0  # tenant 4 keeps all 100 days
    for chunk in plan.chunks:
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert per_tenant_eligible(admin, table, own) == {}
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected


def test_two_keys_of_the_policy_map_for_one_tenant_give_the_longest_retention(
    schema: str, conn: Any, admin: Any
) -> None:
    interleaved(admin, schema, 1_000)
    # '007' and '7' are one tenant of an integer column; sorted, '7' (10 days) would come last.
    policy = one_pass(schema, tenant_retention={"007": "365 days", "7": "10 days"})
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    frozen = Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)
    assert [(t, r) for t, r, _, _ in frozen] == [("7", "365 days")]


@pytest.mark.parametrize("chunk_by", ["block", "key"])
def test_a_policy_that_lost_its_tenant_column_cannot_bypass_the_frozen_tenant_cutoffs(
    schema: str, conn: Any, admin: Any, chunk_by: str
) -> None:
    table = interleaved(admin, schema, 2_000)
    policy = one_pass(schema, chunk_by=chunk_by, tenant_retention={"1": "60 days"})
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    # The tenant column removed before the chunks ran: its statements would test no tenant at all, and
    # tenant 1's rows between 30 and 60 days old would go.
    bare = make_policy(schema, chunk_by=chunk_by, batch_size=500, chunk_rows=2_000)
    assert bare.tenant_column is None
    # (A key chunk planned per tenant is refused earlier: its ledger row names tenants.)
    refused = "restore tenant_column" if chunk_by == "block" else "names tenants but policy .* has no tenant_column"
    for chunk in plan.chunks:
        with pytest.raises(PermanentError, match=refused):
            run_chunk(conn, bare, plan.cutoff, chunk)
    with pytest.raises(PermanentError, match="planned with per-tenant retention"):
        measure_leftovers(conn, bare, CUTOFF, ledger=Ledger(policy.ledger_schema), run_key=plan.run_key)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before


def test_verify_tells_a_dead_lettered_tenant_from_a_missing_chunk(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    rows(admin, f'CREATE TABLE "{schema}".orders (event_id bigint REFERENCES {table} (id))')
    rows(
        admin,
        f'INSERT INTO "{schema}".orders SELECT id FROM {table} WHERE tenant_id = 3 AND status <> %(s)s'
        " AND created_at < %(c)s ORDER BY id LIMIT 3",
        {"s": "open", "c": CUTOFF},
    )
    policy = one_pass(schema, chunk_rows=2_000, batch_size=400, target_batch_time=0)
    plan = plan_run(conn, policy, CUTOFF)
    assert len(plan.chunks) >= 3
    first, *others = plan.chunks
    with pytest.raises(PermanentError, match="tenant 3"):
        run_chunk(conn, policy, plan.cutoff, first)
    assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, first.key)["state"] == "complete"
    ledger, keys = Ledger(policy.ledger_schema), [c.key for c in plan.chunks]
    # One chunk left a tenant, the others not run yet: both named, each for what it is.
    text = verify_run(conn, ledger, plan.run_key, keys).describe()
    assert f"1 of {len(keys)} expected chunk(s) complete, 1 chunk(s) with tenant(s) left as dead letters" in text
    assert f"missing: {', '.join(c.key for c in others)};" in text
    assert f"dead letters (tenants not purged): {first.key} (tenant 3 left: foreign key violation" in text
    for chunk in others:
        run_chunk(conn, policy, plan.cutoff, chunk)
    verification = verify_run(conn, ledger, plan.run_key, keys)
    # Every chunk complete, one tenant left: the message must not call a complete chunk missing.
    assert not verification.ok and verification.missing == [] and verification.complete == len(keys)
    text = verification.describe()
    assert text.startswith(
        f"run {plan.run_key}: {len(keys)} of {len(keys)} expected chunk(s) complete,"
        " 1 chunk(s) with tenant(s) left as dead letters; dead letters (tenants not purged):"
        f" {first.key} (tenant 3 left: foreign key violation"
    ), text
    assert "missing" not in text
    # The cause fixed and the chunk retried, the run verifies.
    rows(admin, f'DELETE FROM "{schema}".orders')
    run_chunk(conn, policy, plan.cutoff, first)
    assert verify_run(conn, ledger, plan.run_key, keys).ok
    assert per_tenant_eligible(admin, table) == {}
