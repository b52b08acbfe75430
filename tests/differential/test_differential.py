"""The differential oracle suite: generated tables, policies and faults, run by the real engine on the
real PostgreSQL, checked against an oracle that shares no code with the engine (docs/testing.md)."""

from __future__ import annotations

import pytest
from hypothesis import given

from .cases import Case, cases, held_cases, night_cases
from .fixed import FIXED
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


@fuzz_settings("held")
@given(held_cases())
def test_dead_letters(case: Case) -> None:
    """A tenant held after the plan: a dead letter, then the redo once released."""
    run_case(case)


@fuzz_settings("nights")
@given(night_cases())
def test_nights(case: Case) -> None:
    """A partitioned table run several nights in a row with a chunk budget smaller than its leaves."""
    run_case(case)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed(name: str) -> None:
    """The fixed cases of tests/differential/fixed.py: shapes the generator draws too, always run."""
    run_case(FIXED[name]())
