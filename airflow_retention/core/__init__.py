"""The Airflow-free core of airflow-retention: policy, SQL, ledger, planner and chunk engine.

Everything under this package works on a plain DB-API connection (psycopg2 or psycopg 3), so it can be
tested and reused without Airflow.

**The stable core API** is what this package exports (:data:`__all__`, docs/api.md): import it from
here, ``from airflow_retention.core import plan_run, run_chunk, verify_run``. Those names keep their
meaning across minor releases; a name leaves only after a release in which it warns
(CHANGELOG.md). The modules below (``core.planning.planner``, ``core.running.engine``, …) are the
implementation: their layout may change from one release to the next. The names are resolved on first
use, so that importing one module of the core does not import all of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and the API docs see them
    from airflow_retention.core.errors import (
        IncompleteRunError,
        PermanentError,
        PolicyError,
        RetentionError,
        RetryableError,
        TableMissing,
    )
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.ledger.records import Attempt, ChunkSpec
    from airflow_retention.core.planning.cutoff import format_cutoff, freeze_cutoff, parse_cutoff, run_key
    from airflow_retention.core.planning.planner import compute_plan, plan_run
    from airflow_retention.core.planning.plans import Plan, Preview
    from airflow_retention.core.policy.loading import load_policies
    from airflow_retention.core.policy.model import RetentionPolicy
    from airflow_retention.core.running.context import ChunkResult
    from airflow_retention.core.running.engine import run_chunk
    from airflow_retention.core.running.verify import (
        Leftovers,
        MissedRun,
        Verification,
        measure_leftovers,
        missed_runs,
        verify_run,
    )

# Each public name and the module that defines it.
_HOMES = {
    "RetentionPolicy": "airflow_retention.core.policy.model",
    "load_policies": "airflow_retention.core.policy.loading",
    "freeze_cutoff": "airflow_retention.core.planning.cutoff",
    "format_cutoff": "airflow_retention.core.planning.cutoff",
    "parse_cutoff": "airflow_retention.core.planning.cutoff",
    "run_key": "airflow_retention.core.planning.cutoff",
    "plan_run": "airflow_retention.core.planning.planner",
    "compute_plan": "airflow_retention.core.planning.planner",
    "Plan": "airflow_retention.core.planning.plans",
    "Preview": "airflow_retention.core.planning.plans",
    "run_chunk": "airflow_retention.core.running.engine",
    "ChunkResult": "airflow_retention.core.running.context",
    "verify_run": "airflow_retention.core.running.verify",
    "Verification": "airflow_retention.core.running.verify",
    "missed_runs": "airflow_retention.core.running.verify",
    "MissedRun": "airflow_retention.core.running.verify",
    "measure_leftovers": "airflow_retention.core.running.verify",
    "Leftovers": "airflow_retention.core.running.verify",
    "Ledger": "airflow_retention.core.ledger.ledger",
    "ChunkSpec": "airflow_retention.core.ledger.records",
    "Attempt": "airflow_retention.core.ledger.records",
    "RetentionError": "airflow_retention.core.errors",
    "PolicyError": "airflow_retention.core.errors",
    "PermanentError": "airflow_retention.core.errors",
    "RetryableError": "airflow_retention.core.errors",
    "IncompleteRunError": "airflow_retention.core.errors",
    "TableMissing": "airflow_retention.core.errors",
}

__all__ = [
    "Attempt",
    "ChunkResult",
    "ChunkSpec",
    "IncompleteRunError",
    "Ledger",
    "Leftovers",
    "MissedRun",
    "PermanentError",
    "Plan",
    "PolicyError",
    "Preview",
    "RetentionError",
    "RetentionPolicy",
    "RetryableError",
    "TableMissing",
    "Verification",
    "compute_plan",
    "format_cutoff",
    "freeze_cutoff",
    "load_policies",
    "measure_leftovers",
    "missed_runs",
    "parse_cutoff",
    "plan_run",
    "run_chunk",
    "run_key",
    "verify_run",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
