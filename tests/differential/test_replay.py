"""Replay every reproducer committed under ``tests/differential/reproducers/``: cases the search (or a
mutation check) found, kept so that the bug they showed can never come back unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from .cases import Case
from .harness import run_case

REPRODUCERS = sorted((Path(__file__).parent / "reproducers").glob("*.json"))


@pytest.mark.parametrize("path", REPRODUCERS, ids=[p.stem for p in REPRODUCERS])
def test_replay(path: Path) -> None:
    run_case(Case.from_json(path.read_text()))
