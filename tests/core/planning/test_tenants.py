"""Tenants in one pass, on both drivers: block chunks that delete every tenant's rows of their blocks
and count them per tenant in the batch's own transaction; per-tenant retention frozen per run; a
per-tenant cap per run; bad maps refused."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_retention.core.errors import PermanentError, PolicyError
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.verify import measure_leftovers, verify_run
from tests.core.helpers import CUTOFF, ledger_chunk, make_policy, rows, scalar
from tests.core.partition_helpers import create_monthly
from tests.core.tenant_helpers import (
    ANCHOR,
    interleaved,
    ledger_tenant_counts,
    one_pass,
    per_tenant_eligible,
    purge,
    reference_expired_rows,
)


def test_one_pass_deletes_every_tenant_and_counts_each_exactly(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema)
    plan = purge(conn, policy)
    assert len(plan.chunks) > 1 and all(c.tenants is None for c in plan.chunks)
    assert per_tenant_eligible(admin, table) == {}
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    # Per chunk, the tenant counts add up to the chunk's rows_deleted.
    for chunk in plan.chunks:
        row = ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)
        counted = scalar(
            admin,
            f'SELECT coalesce(sum(rows_deleted), 0) FROM "{policy.ledger_schema}".tenant_counts'
            " WHERE run_key = %(r)s AND chunk_key = %(c)s",
            {"r": plan.run_key, "c": chunk.key},
        )
        assert counted == row["rows_deleted"]
    summed = Ledger(policy.ledger_schema).tenant_counts(conn, plan.run_key)
    assert {t["tenant"]: t["rows_deleted"] for t in summed} == expected
    assert [t["rows_deleted"] for t in summed] == sorted(expected.values(), reverse=True)
    assert verify_run(conn, Ledger(policy.ledger_schema), plan.run_key, [c.key for c in plan.chunks]).ok


def test_a_chunk_summary_names_its_top_tenants(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema, 2_000)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, chunk_rows=100_000)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    summary = run_chunk(conn, policy, plan.cutoff, chunk).summary()
    assert summary["tenants"] == len(expected) == 8
    top = sorted(expected.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert [tuple(t) for t in summary["top_tenants"]] == top


def test_one_pass_with_an_archive_and_a_dry_run_counts_per_tenant(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema, 3_000)
    rows(admin, f'CREATE TABLE "{schema}".archive (LIKE {table})')
    expected = per_tenant_eligible(admin, table)
    dry = one_pass(schema, dry_run=True)
    dry_plan = purge(conn, dry)
    matched = dict(
        rows(
            admin,
            f'SELECT tenant, sum(rows_matched)::bigint FROM "{dry.ledger_schema}".tenant_counts'
            " WHERE run_key = %(k)s GROUP BY 1",
            {"k": dry_plan.run_key},
        )
    )
    assert matched == expected and per_tenant_eligible(admin, table) == expected
    policy = one_pass(schema, archive_table=f"{schema}.archive")
    plan = purge(conn, policy)
    archived = dict(
        rows(
            admin,
            f'SELECT tenant, sum(rows_archived)::bigint FROM "{policy.ledger_schema}".tenant_counts'
            " WHERE run_key = %(k)s GROUP BY 1",
            {"k": plan.run_key},
        )
    )
    assert archived == expected == ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)
    assert dict(rows(admin, f'SELECT tenant_id::text, count(*) FROM "{schema}".archive GROUP BY 1')) == expected


def test_tenant_retention_overrides_and_is_frozen_for_the_run(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    # Tenants 1 and 2 keep 60 days instead of 30; tenant 3 only 10.
    policy = one_pass(schema, tenant_retention={1: "60 days", "2": "P60D", 3: "10 days"})
    own = {
        "1": CUTOFF.replace(month=5, day=2),
        "2": CUTOFF.replace(month=5, day=2),
        "3": CUTOFF.replace(day=21),
    }
    expected = per_tenant_eligible(admin, table, own)
    base = per_tenant_eligible(admin, table)
    assert expected["1"] < base["1"] and expected["3"] > base["3"] and expected["4"] == base["4"]
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    frozen = Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)
    assert [(t, c) for t, _, c, _ in frozen] == sorted(own.items())
    # The map changes mid-run: the run keeps its frozen cutoffs.
    changed = one_pass(schema, tenant_retention={1: "1 day"})
    for chunk in plan.chunks:
        run_chunk(conn, changed, plan.cutoff, chunk)
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    assert per_tenant_eligible(admin, table, own) == {}
    assert per_tenant_eligible(admin, table)["1"] > 0  # tenant 1's rows between 60 and 30 days are kept
    assert measure_leftovers(conn, policy, CUTOFF, ledger=Ledger(policy.ledger_schema), run_key=plan.run_key).count == 0


def test_tenant_retention_in_key_chunks_too(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema, 4_000)
    own = {"1": CUTOFF.replace(month=5, day=2)}
    expected = per_tenant_eligible(admin, table, own)
    policy = make_policy(schema, tenant_column="tenant_id", tenant_retention={"1": "60 days"}, chunk_rows=1_000)
    assert policy.chunk_by == "key"
    purge(conn, policy, run_date=ANCHOR)
    assert per_tenant_eligible(admin, table, own) == {} and per_tenant_eligible(admin, table)["1"] > 0
    assert sum(expected.values()) == 4_000 - scalar(admin, f"SELECT count(*) FROM {table}") - 0


def test_tenant_retention_table_is_read_at_planning(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant_id integer PRIMARY KEY, retention interval)')
    rows(admin, f"""INSERT INTO "{schema}".keep VALUES (4, '60 days'), (5, '60 days'), (6, NULL)""")
    own = {"4": CUTOFF.replace(month=5, day=2), "5": CUTOFF.replace(month=5, day=2)}
    expected = per_tenant_eligible(admin, table, own)
    # The policy's map wins over the table for tenant 5.
    policy = one_pass(schema, tenant_retention_table=f"{schema}.keep", tenant_retention={5: "30 days"})
    own["5"] = CUTOFF
    expected = per_tenant_eligible(admin, table, own)
    plan = purge(conn, policy, run_date=ANCHOR)
    sources = {t: s for t, _, _, s in Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)}
    assert sources == {"4": "table", "5": "policy"}
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected


def test_a_tenant_cap_defers_the_rest_of_its_rows(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    expected = per_tenant_eligible(admin, table)
    cap = 300
    policy = one_pass(schema, max_rows_per_tenant=cap, batch_size=200, target_batch_time=0)
    plan = purge(conn, policy)
    counts = ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)
    # Each tenant stops at the first batch that takes it to the cap; its remaining rows are deferred.
    assert all(cap <= counts[t] < cap + 200 for t in expected)
    left = per_tenant_eligible(admin, table)
    assert all(left[t] == expected[t] - counts[t] > 0 for t in expected)
    ledger = Ledger(policy.ledger_schema)
    assert verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks]).ok  # not a failure
    leftovers = measure_leftovers(conn, policy, CUTOFF, ledger=ledger, run_key=plan.run_key)
    assert leftovers.count == sum(left.values()) and leftovers.lag_seconds > 0


def test_bad_tenant_maps_are_refused_naming_the_field(schema: str, conn: Any, admin: Any) -> None:
    with pytest.raises(PolicyError) as info:
        one_pass(schema, tenant_retention={1: "forever"})
    assert info.value.field == "tenant_retention" and "tenant 1" in str(info.value)
    with pytest.raises(PolicyError) as info:
        one_pass(schema, tenant_retention=["1", "2"])
    assert info.value.field == "tenant_retention"
    with pytest.raises(PolicyError) as info:
        make_policy(schema, tenant_retention={1: "9 days"}, chunk_by="block")
    assert info.value.field == "tenant_retention" and "needs tenant_column" in str(info.value)
    with pytest.raises(PolicyError) as info:
        one_pass(schema, max_rows_per_tenant=0)
    assert info.value.field == "max_rows_per_tenant"
    table = interleaved(admin, schema, 1_000)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    with pytest.raises(PermanentError, match=r"field 'tenant_retention': tenant 'acme' is not a value of column"):
        plan_run(conn, one_pass(schema, tenant_retention={"acme": "9 days"}), CUTOFF)
    rows(admin, f'CREATE TABLE "{schema}".keep (tenant integer, days integer)')
    with pytest.raises(PermanentError, match=r"field 'tenant_retention_table'.*lacks column\(s\) tenant_id, retention"):
        plan_run(conn, one_pass(schema, tenant_retention_table=f"{schema}.keep"), CUTOFF)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before
    assert Ledger(f"{schema}_ledger").version(conn) is None or not rows(admin, f'SELECT 1 FROM "{schema}_ledger".runs')


@pytest.mark.parametrize("chunk_by", ["block", "key"])  # one pass, and a key chunk that packs the tenants
def test_a_failing_tenant_is_isolated_recorded_and_purged_by_the_retry(
    schema: str, conn: Any, admin: Any, driver: str, chunk_by: str
) -> None:
    table = interleaved(admin, schema)
    # Orders still reference some of tenant 3's expired rows: deleting them violates a foreign key.
    reference_expired_rows(admin, schema, table)
    expected = per_tenant_eligible(admin, table)
    policy = one_pass(schema, chunk_by=chunk_by, chunk_rows=100_000, batch_size=400, target_batch_time=0)
    plan = plan_run(conn, policy, CUTOFF)
    (chunk,) = plan.chunks
    assert chunk.tenants == (None if chunk_by == "block" else tuple(str(t) for t in range(1, 9)))
    with pytest.raises(PermanentError, match=r"tenant 3: foreign key violation: rows of table orders still reference"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    left = per_tenant_eligible(admin, table)
    assert set(left) == {"3"} and left["3"] >= 5  # every other tenant purged
    counts = ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)
    assert {t: n for t, n in counts.items() if t != "3"} == {t: n for t, n in expected.items() if t != "3"}
    (letter,) = rows(
        admin,
        f'SELECT tenant, sqlstate, failure_class, attempts, resolved_at FROM "{policy.ledger_schema}".dead_letters',
    )
    assert letter[:2] == ("3", "23503") and "orders" in letter[2] and letter[3] == 1 and letter[4] is None
    ledger = Ledger(policy.ledger_schema)
    verification = verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks])
    assert not verification.ok and "tenant 3 left: foreign key violation" in verification.describe()
    # Retried before the cause is fixed: still failing, counted as a second attempt, nothing else touched.
    with pytest.raises(PermanentError, match="tenant 3"):
        run_chunk(conn, policy, plan.cutoff, chunk)
    assert scalar(admin, f'SELECT attempts FROM "{policy.ledger_schema}".dead_letters') == 2
    # (Its batches before the one holding the referenced rows may have gone through, and are counted.)
    left = per_tenant_eligible(admin, table)
    assert set(left) == {"3"} and left["3"] >= 5
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key)["3"] == expected["3"] - left["3"]
    # The cause fixed, the retry purges tenant 3 alone and resolves its dead letter.
    rows(admin, f'DELETE FROM "{schema}".orders')
    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert result.rows_deleted == left["3"] and not result.already_complete
    assert per_tenant_eligible(admin, table) == {}
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    assert ledger_chunk(admin, policy.ledger_schema, plan.run_key, chunk.key)["rows_deleted"] == sum(expected.values())
    assert scalar(admin, f'SELECT resolved_at IS NOT NULL FROM "{policy.ledger_schema}".dead_letters')
    assert verify_run(conn, ledger, plan.run_key, [c.key for c in plan.chunks]).ok
    assert run_chunk(conn, policy, plan.cutoff, chunk).already_complete


def test_tenant_values_written_another_way_still_match_their_rows(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema)
    # '007' and '+1' are tenants 7 and 1 of an integer column: rows print as '7' and '1'.
    own = {"7": CUTOFF.replace(month=5, day=2), "1": CUTOFF.replace(month=5, day=2)}
    expected = per_tenant_eligible(admin, table, own)
    policy = one_pass(schema, tenant_retention={"007": "60 days", "+1": "60 days"})
    plan = purge(conn, policy, run_date=ANCHOR)
    assert [t for t, _, _, _ in Ledger(policy.ledger_schema).tenant_cutoffs(conn, plan.run_key)] == ["1", "7"]
    assert ledger_tenant_counts(admin, policy.ledger_schema, plan.run_key) == expected
    assert per_tenant_eligible(admin, table)["7"] > 0  # tenant 7's rows between 60 and 30 days are kept


def test_a_tenant_cutoff_in_the_future_is_refused(schema: str, conn: Any, admin: Any) -> None:
    from datetime import datetime, timedelta, timezone

    from airflow_retention.core.ledger.records import ChunkSpec

    table = interleaved(admin, schema, 1_000)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    # A lone chunk with yesterday's cutoff: its run date is 90 days later, so a 7-day tenant's cutoff
    # would be about 83 days in the future.
    policy = one_pass(schema, retention="90 days", tenant_retention={"7": "7 days"})
    yesterday = datetime.now(timezone.utc) - timedelta(days=1)
    with pytest.raises(PermanentError, match=r"tenant '7'.s cutoff .* is in the future"):
        run_chunk(conn, policy, yesterday, ChunkSpec(key="all:0-100000", lo=0, hi=100_000), lone=True)
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before


def test_a_run_whose_policy_lost_its_tenant_rules_fails_rather_than_purge_early(
    schema: str, conn: Any, admin: Any
) -> None:
    table = interleaved(admin, schema, 2_000)
    policy = one_pass(schema, tenant_retention={"1": "60 days"})
    plan = plan_run(conn, policy, CUTOFF, run_date=ANCHOR)
    before = scalar(admin, f"SELECT count(*) FROM {table}")
    with pytest.raises(PermanentError, match="planned with per-tenant retention"):
        run_chunk(conn, one_pass(schema), plan.cutoff, plan.chunks[0])
    assert scalar(admin, f"SELECT count(*) FROM {table}") == before


def test_a_deferred_foreign_key_is_isolated_too(schema: str, conn: Any, admin: Any) -> None:
    table = interleaved(admin, schema, 2_000)
    rows(
        admin,
        f'CREATE TABLE "{schema}".orders (event_id bigint REFERENCES {table} (id) DEFERRABLE INITIALLY DEFERRED)',
    )
    rows(
        admin,
        f"INSERT INTO \"{schema}\".orders SELECT id FROM {table} WHERE tenant_id = 1 AND status <> 'open'"
        " AND created_at < %(c)s LIMIT 1",
        {"c": CUTOFF},
    )
    policy = one_pass(schema, chunk_rows=100_000)
    plan = plan_run(conn, policy, CUTOFF)
    with pytest.raises(PermanentError, match="tenant 1: foreign key violation"):
        run_chunk(conn, policy, plan.cutoff, plan.chunks[0])
    assert set(per_tenant_eligible(admin, table)) == {"1"}


@pytest.mark.timeout(120)  # the regression it guards against was a loop, not a failure
def test_a_dead_letter_of_a_leaf_dropped_since_is_resolved_by_the_retry(schema: str, conn: Any, admin: Any) -> None:
    """The retry of a one-pass leaf chunk with a dead letter, after the leaf was dropped (pg_partman's
    retention, say): its rows are no longer the table's to purge. The retry resolves the dead letter
    and completes, touching nothing else (it once took the failing batch again forever)."""
    table = create_monthly(admin, schema, status="'closed'")
    leaf = f'"{schema}"."m03"'
    # A trigger on one leaf refuses to delete tenant 3's rows there.
    rows(
        admin,
        f'CREATE FUNCTION "{schema}".refuse_three() RETURNS trigger LANGUAGE plpgsql AS $$'
        " BEGIN IF OLD.tenant_id = 3 THEN RAISE EXCEPTION 'tenant 3 is on hold'; END IF; RETURN OLD; END $$",
    )
    rows(
        admin,
        f'CREATE TRIGGER refuse_three BEFORE DELETE ON {leaf} FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse_three()',
    )
    policy = one_pass(schema, chunk_rows=100_000, batch_size=400, target_batch_time=0)
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m03")
    for _ in (1, 2):  # the first delivery, then a retry that walks the dead letter again
        with pytest.raises(PermanentError, match=r"tenant 3: raised by a trigger"):
            run_chunk(conn, policy, plan.cutoff, chunk)
    assert scalar(admin, f"SELECT count(*) FROM {leaf} WHERE tenant_id <> 3") == 0
    kept = scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at >= %(c)s", {"c": CUTOFF})
    rows(admin, f"DROP TABLE {leaf}")
    result = run_chunk(conn, policy, plan.cutoff, chunk)
    assert result.rows_deleted == 0 and not result.already_complete
    assert rows(admin, f'SELECT tenant, resolved_at IS NOT NULL FROM "{policy.ledger_schema}".dead_letters') == [
        ("3", True)
    ]
    assert scalar(admin, f"SELECT count(*) FROM {table} WHERE created_at >= %(c)s", {"c": CUTOFF}) == kept
    assert run_chunk(conn, policy, plan.cutoff, chunk).already_complete
