"""Fixtures of the fault drills."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.core.helpers import rows


@pytest.fixture
def purger(admin: Any, schema: str) -> Iterator[str]:
    """A login role with no privilege at all: each drill grants what the docs grant, and nothing else."""
    role = f"purger_{uuid.uuid4().hex[:8]}"
    rows(admin, f'CREATE ROLE "{role}" LOGIN')
    yield role
    rows(admin, f'DROP SCHEMA IF EXISTS "{schema}_ledger" CASCADE')
    rows(admin, f'DROP OWNED BY "{role}"')
    rows(admin, f'DROP ROLE "{role}"')
