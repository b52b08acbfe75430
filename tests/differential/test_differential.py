"""The differential oracle suite: generated tables, policies and faults, run by the real engine on the
real PostgreSQL, checked against an oracle that shares no code with the engine (docs/testing.md)."""

from __future__ import annotations

from hypothesis import given

from .cases import Case, cases
from .harness import run_case
from .settings import fuzz_settings


@fuzz_settings("plain")
@given(cases(partitioned=False))
def test_plain_tables(case: Case) -> None:
    run_case(case)


@fuzz_settings("partitioned")
@given(cases(partitioned=True))
def test_partitioned_tables(case: Case) -> None:
    run_case(case)


@fuzz_settings("faults")
@given(cases(faults=True))
def test_faults(case: Case) -> None:
    run_case(case)
