"""A detached partition moved into ``detached_schema`` never meets a name already there (issue 24): the
table and its indexes renamed to the first free ``<name>_<n>`` first (also when only the name of its row
type's array type is taken), in the transaction
that moves it, on the concurrent path (no DEFAULT, no condition) and the atomic one. Against the real
PostgreSQL, on both drivers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from airflow_retention.core.db.move import free_name
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from tests.core.helpers import CONDITION, CUTOFF, make_policy, rows, scalar
from tests.core.partition_helpers import create_monthly, partitions_of, relations_in


def test_free_name_keeps_a_free_name_and_numbers_a_taken_one_within_63_bytes() -> None:
    assert free_name("m01", set()) == "m01"
    assert free_name("m01", {"m01"}) == "m01_1"
    assert free_name("m01", {"m01", "m01_1", "m01_2"}) == "m01_3"
    long = "é" * 31 + "x"  # 63 bytes
    renamed = free_name(long, {long})
    assert renamed.endswith("_1") and len(renamed.encode()) <= 63 and renamed.startswith("é" * 30)


def index_names(admin: Any, schema: str, table: str) -> set[str]:
    return {
        r[0]
        for r in rows(
            admin,
            "SELECT indexname FROM pg_indexes WHERE schemaname = %(s)s AND tablename = %(t)s",
            {"s": schema, "t": table},
        )
    }


@pytest.fixture
def detached(schema: str, admin: Any) -> Iterator[str]:
    """The policy's detached_schema, and the monthly table of partition_helpers in ``schema``."""
    create_monthly(admin, schema, status="'closed'")
    name = f"{schema}_detached"
    rows(admin, f'CREATE SCHEMA "{name}"')
    yield name
    rows(admin, f'DROP SCHEMA "{name}" CASCADE')


def detach_january(conn: Any, schema: str, detached: str, condition: str | None) -> Any:
    """Plan the detach policy and run January's chunk; its result."""
    policy = make_policy(
        schema,
        chunk_by="block",
        key_column=None,
        condition=condition,
        expired_partitions="detach",
        detached_schema=detached,
    )
    plan = plan_run(conn, policy, CUTOFF)
    chunk = next(c for c in plan.chunks if c.partition == f"{schema}.m01")
    return run_chunk(conn, policy, CUTOFF, chunk)


@pytest.mark.parametrize("condition", [None, CONDITION], ids=["concurrent", "atomic"])
def test_a_partition_detached_into_a_schema_holding_its_names_is_moved_under_new_ones(
    schema: str, conn: Any, admin: Any, detached: str, condition: str | None
) -> None:
    # An earlier January, with an index of the name January's own index has, already there.
    rows(admin, f'CREATE TABLE "{detached}".m01 (id bigint)')
    rows(admin, f'INSERT INTO "{detached}".m01 VALUES (-1)')
    january_indexes = index_names(admin, schema, "m01")
    for index in january_indexes:
        rows(admin, f'CREATE TABLE "{detached}"."{index}" ()')  # a relation of each index's name
    january = scalar(admin, f'SELECT count(*) FROM "{schema}".m01')
    result = detach_january(conn, schema, detached, condition)

    assert (result.outcome, result.rows_deleted) == ("detached", january)
    assert f"{schema}.m01" not in partitions_of(admin, f'"{schema}".events')
    assert {"m01", "m01_1"} <= relations_in(admin, detached)
    assert scalar(admin, f'SELECT count(*) FROM "{detached}".m01_1') == january
    assert scalar(admin, f'SELECT array_agg(id) FROM "{detached}".m01') == [-1]  # the earlier one untouched
    assert index_names(admin, detached, "m01_1") == {f"{i}_1" for i in january_indexes}


def test_a_type_named_like_the_partitions_array_type_is_no_clash_either(
    schema: str, conn: Any, admin: Any, detached: str
) -> None:
    rows(admin, f'CREATE TYPE "{detached}"."_m01" AS (x int)')  # the name of m01's row type's array type
    assert detach_january(conn, schema, detached, None).outcome == "detached"
    assert "m01_1" in relations_in(admin, detached)
