"""Hypothesis settings of the differential suite, from the environment (``./dev fuzz`` sets them).

``RETENTION_FUZZ_CASES``: examples per test function (default: the fixed CI budget). ``RETENTION_FUZZ_SEED``:
a seed for a search of its own; unset, every run draws the same cases (``derandomize``), so CI is
deterministic. The example database is off: a failure is kept as a reproducer file instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, seed, settings

# The CI budget, per test function: a few hundred cases in all, a few minutes on two shared cores.
DEFAULT_CASES = {"plain": 80, "partitioned": 60, "faults": 50, "dag": 4, "nights": 6, "held": 8}


def fuzz_settings(kind: str) -> Callable[[Any], Any]:
    cases = int(os.environ.get("RETENTION_FUZZ_CASES", "0")) or DEFAULT_CASES[kind]
    if kind == "dag":  # each a whole DAG run through Airflow (seconds each): a tenth of the budget
        cases = max(DEFAULT_CASES[kind], cases // 10)
    if kind == "nights":  # each several runs (one per night): a fifth of the budget
        cases = max(DEFAULT_CASES[kind], cases // 5)
    if kind == "held":  # one fault among the others: a third of the budget
        cases = max(DEFAULT_CASES[kind], cases // 3)
    chosen_seed = os.environ.get("RETENTION_FUZZ_SEED")

    def apply(fn: Any) -> Any:
        fn = settings(
            max_examples=cases,
            derandomize=chosen_seed is None,
            database=None,
            deadline=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
            # A DAG run takes seconds: shrinking one would take many minutes (its reproducer is kept).
            phases=[p for p in Phase if kind != "dag" or p not in (Phase.shrink, Phase.explain)],
        )(fn)
        if chosen_seed is not None:
            fn = seed(int(chosen_seed))(fn)
        return fn

    return apply
