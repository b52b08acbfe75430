"""Fixtures of the core tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def bounded_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Index-bounded block chunks on test-sized tables: any table size, and a gap of more than 8 blocks
    without an eligible row splits a chunk (the real thresholds are 4,096 and 32,768 blocks)."""
    from airflow_retention.core.planning.walkers import spans

    monkeypatch.setattr(spans, "BOUNDED_MIN_BLOCKS", 0)
    monkeypatch.setattr(spans, "BOUNDED_GAP_BLOCKS", 8)
