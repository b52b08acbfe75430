"""The package beside pg_partman 4.7 (Debian's postgresql-15-partman), on sets created as partman's users
create them: daily, monthly, id-controlled and sub-partitioned; ``drop``, ``detach`` and ``delete``;
partman's own retention racing the purge; late rows in partman's DEFAULT partition. After every purge
partman's ``run_maintenance()`` and ``check_default()`` must succeed, and the rows left must be exactly
those the policy keeps (computed by the tests' own SQL)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.errors import PermanentError

from .helpers import CONDITION, TODAY, Partman, days_ago


def kept(pm: Partman, table: str, cutoff: object, condition: str | None = None) -> set[int]:
    """The rows the policy keeps: at or after the cutoff, or (with a condition) held back by it."""
    held = f" OR NOT coalesce(({condition}), false)" if condition else ""
    return pm.ids(f"public.{table}", f"created_at >= %(c)s{held}", {"c": cutoff})


def months_ending_by(first: datetime, cutoff: datetime, prefix: str) -> list[str]:
    """partman's names of the monthly children from ``first`` whose month ends at or before ``cutoff``."""
    names, month = [], first
    while True:
        following = (month + timedelta(days=32)).replace(day=1)
        if following > cutoff:
            return names
        names.append(f"{prefix}_p{month:%Y_%m}")
        month = following


def assert_partman_healthy(pm: Partman) -> dict[str, int]:
    """partman's maintenance of every set and its DEFAULT check run without an error; returns the DEFAULT
    partitions that hold rows."""
    pm.maintain()
    return pm.check_default()


def detached_rows(pm: Partman) -> int:
    return sum(
        int(pm.one(f'SELECT count(*) FROM retention_detached."{t}"')) for t in pm.tables_in("retention_detached")
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"expired_partitions": "drop"},
        {"expired_partitions": "detach", "detached_schema": "retention_detached"},
        {"expired_partitions": "delete", "condition": CONDITION},
    ],
    ids=["drop", "detach", "delete"],
)
def test_a_daily_set_is_purged_and_partman_keeps_maintaining_it(pm: Partman, fields: dict[str, str]) -> None:
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    total = pm.fill("ev_daily", days_ago(30), TODAY + timedelta(days=2))
    assert_partman_healthy(pm)
    policy = pm.policy("ev_daily", **fields)
    planned = pm.plan(policy)
    expect = kept(pm, "ev_daily", planned.cutoff, policy.condition)
    before_children = pm.children("ev_daily")
    purge = pm.run(policy, planned)

    assert pm.ids("public.ev_daily") == expect
    outcomes = list(purge.outcomes.values())
    if policy.expired_partitions == "delete":
        assert "dropped" not in outcomes and "detached" not in outcomes
        assert pm.children("ev_daily") == before_children
    else:
        # Twenty days wholly before the cutoff, each removed whole.
        action = {"drop": "dropped", "detach": "detached"}[policy.expired_partitions]
        assert outcomes.count(action) == 20, purge.outcomes
        gone = {c for c in before_children if c not in pm.children("ev_daily")}
        assert len(gone) == 20
        if policy.expired_partitions == "detach":
            assert {g.split(".")[1] for g in gone} == pm.tables_in("retention_detached")
            assert detached_rows(pm) + len(expect) == total  # nothing lost
    assert assert_partman_healthy(pm) == {}
    # partman keeps adding days ahead; none of the removed days come back.
    assert len(pm.children("ev_daily")) >= len(before_children) - (
        0 if fields["expired_partitions"] == "delete" else 20
    )


def test_a_monthly_set_drops_whole_months_and_deletes_rows_of_the_month_at_the_cutoff(pm: Partman) -> None:
    first = (TODAY - timedelta(days=100)).replace(day=1)
    pm.create_time_set("ev_monthly", "monthly", start=first, premake=2)
    pm.fill("ev_monthly", first, TODAY, "3 hours")
    policy = pm.policy("ev_monthly", retention="45 days", expired_partitions="drop")
    planned = pm.plan(policy)
    expect = kept(pm, "ev_monthly", planned.cutoff)
    months_before = pm.children("ev_monthly")
    purge = pm.run(policy, planned)

    assert pm.ids("public.ev_monthly") == expect
    whole = {k.split(":", 1)[1] for k, o in purge.outcomes.items() if o == "dropped"}
    assert whole == set(months_ending_by(first, planned.cutoff, "public.ev_monthly")) and len(whole) >= 2
    # The month at the cutoff keeps its partition; its expired rows went in batches.
    assert f"public.ev_monthly_p{planned.cutoff:%Y_%m}" in pm.children("ev_monthly")
    assert sum(r.rows_deleted for r in purge.results if r.outcome not in ("dropped",)) > 0
    assert len(pm.children("ev_monthly")) == len(months_before) - len(whole)
    assert assert_partman_healthy(pm) == {}


def test_an_id_controlled_set_is_purged_row_by_row_never_by_whole_partitions(pm: Partman) -> None:
    pm.create_id_set("ev_ids", 1000)
    pm.fill("ev_ids", days_ago(30), TODAY, "10 minutes", ids=True)
    assert_partman_healthy(pm)  # partman premakes id partitions ahead of the largest id
    policy = pm.policy("ev_ids", expired_partitions="drop", condition=CONDITION)
    planned = pm.plan(policy)
    expect = kept(pm, "ev_ids", planned.cutoff, CONDITION)
    before = pm.children("ev_ids")
    purge = pm.run(policy, planned)

    assert pm.ids("public.ev_ids") == expect
    # A RANGE bound on the id proves nothing about time: no partition is removed whole.
    assert not any(k.startswith(("drop:", "detach:")) for k in purge.outcomes)
    assert pm.children("ev_ids") == before
    assert sum(r.rows_deleted for r in purge.results) > 0
    assert_partman_healthy(pm)


@pytest.mark.parametrize(
    "fields",
    [{"expired_partitions": "drop"}, {"expired_partitions": "detach", "detached_schema": "retention_detached"}],
    ids=["drop", "detach"],
)
def test_removing_a_month_of_a_sub_partitioned_set_leaves_partmans_maintenance_working(
    pm: Partman, fields: dict[str, str]
) -> None:
    """partman keeps a ``part_config`` row per sub-parent; one left behind for a month that is gone made
    every later ``run_maintenance()`` fail ("Given parent table not found in system catalogs") and
    ``check_default()`` fail ("null values cannot be formatted as an SQL identifier")."""
    first = (TODAY - timedelta(days=100)).replace(day=1)
    pm.create_time_set("ev_sub", "monthly", start=first, premake=2, sub_interval="daily")
    pm.fill("ev_sub", first, TODAY, "3 hours")
    assert_partman_healthy(pm)
    policy = pm.policy("ev_sub", retention="45 days", **fields)
    planned = pm.plan(policy)
    expect = kept(pm, "ev_sub", planned.cutoff)
    months = {name for name in pm.part_config() if name.startswith("public.ev_sub_p")}
    purge = pm.run(policy, planned)

    assert pm.ids("public.ev_sub") == expect
    removed = {k.split(":", 1)[1] for k, o in purge.outcomes.items() if o in ("dropped", "detached")}
    # Whole months (sub-parents, configured in partman), and the expired days of the month at the cutoff.
    assert len(removed & months) >= 2 and any(name not in months for name in removed), (removed, months)
    # Forgotten by partman with the partition, in the same transaction; the other months stay configured.
    assert pm.part_config() & removed == set()
    assert months - removed <= pm.part_config()
    assert assert_partman_healthy(pm) == {}  # no DEFAULT holds a row
    if "detached_schema" in fields:
        # Each month with its days and its DEFAULT: nothing of it stays where partman looks.
        detached = pm.tables_in("retention_detached")
        for month in (r.split(".")[1] for r in removed & months):
            assert month in detached and any(t.startswith(f"{month}_p") for t in detached), (month, detached)
            assert not any(t.startswith(month) for t in pm.tables_in("public")), month
        # A late row for a detached month: partman recreates the month in the set, nothing clashes.
        late = planned.cutoff - timedelta(days=60)
        pm.q("INSERT INTO public.ev_sub (created_at, status) VALUES (%(t)s, 'closed')", {"t": late})
        pm.settle("ev_sub")
        pm.purge(policy, TODAY + timedelta(hours=1))
        assert pm.one("SELECT count(*) FROM public.ev_sub WHERE created_at = %(t)s", {"t": late}) == 0
        assert assert_partman_healthy(pm) == {}


def test_detach_without_detached_schema_on_a_partman_set_is_refused_at_planning(pm: Partman) -> None:
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    total = pm.fill("ev_daily", days_ago(30), TODAY)
    policy = pm.policy("ev_daily", expired_partitions="detach")
    with pytest.raises(PermanentError, match=r"field 'detached_schema': pg_partman manages public\.ev_daily") as err:
        pm.plan(policy)
    assert "partition_data_time" in str(err.value) and "nothing was detached" in str(err.value)
    assert pm.one("SELECT count(*) FROM public.ev_daily") == total
    with pytest.raises(PermanentError, match=r"field 'detached_schema'"):  # its own schema is no better
        pm.plan(pm.policy("ev_daily", expired_partitions="detach", detached_schema="public"))
    # A policy changed to detach after planning: the chunk refuses before detaching.
    planned = pm.plan(pm.policy("ev_daily", expired_partitions="drop"))
    chunk = next(c for c in planned.plan.chunks if c.action == "drop")
    with pytest.raises(PermanentError, match=r"field 'detached_schema'"):
        pm.run(policy, planned)
    assert f"public.{chunk.partition.split('.')[1]}" in pm.children("ev_daily")
    assert pm.one("SELECT count(*) FROM public.ev_daily") == total
    # The same table without partman: nothing to refuse (the existing behaviour).
    pm.q("DELETE FROM partman.part_config WHERE parent_table = 'public.ev_daily'")
    pm.purge(policy)
    assert pm.one("SELECT count(*) FROM public.ev_daily") < total


def test_partmans_own_retention_dropping_partitions_between_plan_and_chunks(pm: Partman) -> None:
    """Two retention owners on one table: partman's (15 days) runs after the plan (10 days) and before the
    chunks; the chunks of the days it dropped complete with 0 rows (``partition_gone``), the others drop
    theirs, and the rows left are those the stricter of the two keeps."""
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    pm.fill("ev_daily", days_ago(30), TODAY)
    pm.q(
        "UPDATE partman.part_config SET retention = '15 days', retention_keep_table = false"
        " WHERE parent_table = 'public.ev_daily'"
    )
    policy = pm.policy("ev_daily", expired_partitions="drop")
    planned = pm.plan(policy)
    expect = kept(pm, "ev_daily", planned.cutoff)
    pm.maintain()  # partman drops the days older than 15 days
    purge = pm.run(policy, planned)

    assert pm.ids("public.ev_daily") == expect
    outcomes = list(purge.outcomes.values())
    assert outcomes.count("partition_gone") >= 14 and outcomes.count("dropped") >= 4, purge.outcomes
    assert_partman_healthy(pm)


def test_a_late_row_recreating_a_detached_day_is_detached_again_under_a_new_name(pm: Partman) -> None:
    """A late row lands in the DEFAULT; partman's ``partition_data_time`` recreates its day's child, of the
    name an earlier run moved to ``retention_detached``; the next run's detach used to fail for good
    there (42P07, already exists). Now the newcomer is renamed before the move."""
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    pm.fill("ev_daily", days_ago(30), TODAY)
    policy = pm.policy("ev_daily", expired_partitions="detach", detached_schema="retention_detached")
    pm.purge(policy, days_ago(2))  # detaches the days before 12 days ago
    late_day = days_ago(20)
    child = f"ev_daily_p{late_day:%Y_%m_%d}"
    assert child in pm.tables_in("retention_detached")
    late_id = int(
        pm.one(
            "INSERT INTO public.ev_daily (created_at, status) VALUES (%(t)s, 'closed') RETURNING id",
            {"t": late_day + timedelta(hours=5)},
        )
    )
    assert pm.check_default() == {"public.ev_daily_default": 1}
    pm.q("SELECT partman.partition_data_time('public.ev_daily', p_batch_count => 10)")
    assert f"public.{child}" in pm.children("ev_daily")  # partman recreated the day for the late row

    purge = pm.purge(policy, days_ago(1))
    assert purge.outcomes[f"detach:public.{child}"] == "detached"
    assert {child, f"{child}_1"} <= pm.tables_in("retention_detached")
    assert pm.ids(f"retention_detached.{child}_1") == {late_id}
    assert assert_partman_healthy(pm) == {}


@contextmanager
def owning_role(pm: Partman, table: str) -> Iterator[tuple[str, Partman]]:
    """A login role of the test's own that owns every relation of ``public.<table>`` and nothing of
    partman's, and a connection as it; dropped afterwards, with what it owns (the table too)."""
    role = f"pm_role_{uuid.uuid4().hex[:8]}"
    pm.q(f'CREATE ROLE "{role}" LOGIN')
    try:
        pm.q(f'GRANT CREATE ON DATABASE "{pm.admin.info.dbname}" TO "{role}"')
        for (rel,) in pm.q("SELECT relid::regclass::text FROM pg_partition_tree(%(t)s)", {"t": f"public.{table}"}):
            pm.q(f'ALTER TABLE {rel} OWNER TO "{role}"')
        as_role = Partman(make_dsn(pm.dsn, user=role))
        try:
            yield role, as_role
        finally:
            as_role.close()
    finally:
        pm.q(f'DROP OWNED BY "{role}" CASCADE')
        pm.q(f'DROP ROLE "{role}"')


def test_a_role_without_partmans_grants_is_told_at_planning_when_it_removes_a_month(pm: Partman) -> None:
    """Removing a sub-parent needs to read and delete partman's part_config: checked before anything is
    removed, the missing grant named each time."""
    first = (TODAY - timedelta(days=100)).replace(day=1)
    pm.create_time_set("ev_sub", "monthly", start=first, premake=2, sub_interval="daily")
    total = pm.fill("ev_sub", first, TODAY, "6 hours")
    policy = pm.policy("ev_sub", retention="45 days", expired_partitions="drop")
    with owning_role(pm, "ev_sub") as (role, as_role):
        with pytest.raises(PermanentError, match=rf"role {role} cannot read partman\.part_config") as err:
            as_role.plan(policy)
        assert f'GRANT USAGE ON SCHEMA "partman" TO "{role}"' in str(err.value)
        pm.q(f'GRANT USAGE ON SCHEMA partman TO "{role}"')
        pm.q(f'GRANT SELECT ON partman.part_config, partman.part_config_sub TO "{role}"')
        with pytest.raises(PermanentError, match=rf"role {role} lacks DELETE on partman\.part_config") as err:
            as_role.plan(policy)
        assert f'GRANT DELETE ON "partman"."part_config" TO "{role}"' in str(err.value)
        assert pm.one("SELECT count(*) FROM public.ev_sub") == total
        pm.q(f'GRANT DELETE ON partman.part_config, partman.part_config_sub TO "{role}"')
        as_role.purge(policy)
        assert pm.one("SELECT count(*) FROM public.ev_sub") < total
        assert assert_partman_healthy(pm) == {}


def test_a_role_without_partmans_grants_purges_a_set_whose_removals_partman_does_not_configure(pm: Partman) -> None:
    """Days of a plain daily set are leaves (never in part_config): no partman grant is needed to drop them,
    beside partman installed in the same database; nor for a table partman does not manage."""
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    pm.fill("ev_daily", days_ago(30), TODAY)
    with owning_role(pm, "ev_daily") as (_, as_role):
        policy = pm.policy("ev_daily", expired_partitions="drop")
        purge = as_role.purge(policy)
        assert list(purge.outcomes.values()).count("dropped") == 20
        assert pm.ids("public.ev_daily") == kept(pm, "ev_daily", purge.cutoff)
        assert assert_partman_healthy(pm) == {}


def test_partman_absent_changes_nothing(pm: Partman) -> None:
    """Without the extension (dropped here), a set of the same shape purges as before."""
    pm.create_time_set("ev_daily", "daily", start=days_ago(30))
    pm.fill("ev_daily", days_ago(30), TODAY)
    pm.q("DROP EXTENSION pg_partman")
    policy = pm.policy("ev_daily", expired_partitions="detach")  # no detached_schema: allowed without partman
    planned = pm.plan(policy)
    expect = kept(pm, "ev_daily", planned.cutoff)
    purge = pm.run(policy, planned)
    assert pm.ids("public.ev_daily") == expect
    assert list(purge.outcomes.values()).count("detached") == 20
