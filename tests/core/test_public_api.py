"""The stable core API (issue 33): every name docs/api.md promises is importable from
``airflow_retention.core``, is the object its module defines, and is documented; 0.1.0's module paths
still import, with a DeprecationWarning naming the new path, until 0.3.0."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import airflow_retention.core as core

REPO = Path(__file__).resolve().parents[2]
# What docs/api.md promises: removing one of these from the core API is a breaking change (CHANGELOG.md).
PROMISED = {
    "plan_run", "compute_plan", "Plan", "Preview", "run_chunk", "ChunkResult", "verify_run", "Verification",
    "missed_runs", "MissedRun", "measure_leftovers", "Leftovers", "Ledger", "ChunkSpec", "Attempt",
    "RetentionPolicy", "load_policies", "freeze_cutoff", "format_cutoff", "parse_cutoff", "run_key",
    "RetentionError", "PolicyError", "PermanentError", "RetryableError", "IncompleteRunError", "TableMissing",
}  # fmt: skip
# 0.1.0's paths, as DAG files and docs of that release wrote them, and where each name lives now.
OLD_PATHS = {
    ("planner", "plan_run"): "airflow_retention.core",
    ("planner", "compute_plan"): "airflow_retention.core",
    ("planner", "MAX_TENANTS_PER_CHUNK"): "airflow_retention.core.planning.walkers.keys",
    ("engine", "run_chunk"): "airflow_retention.core",
    ("engine", "ChunkResult"): "airflow_retention.core",
    ("verify", "verify_run"): "airflow_retention.core",
    ("verify", "missed_runs"): "airflow_retention.core",
    ("verify", "measure_leftovers"): "airflow_retention.core",
    ("cutoff", "freeze_cutoff"): "airflow_retention.core",
    ("cutoff", "as_utc"): "airflow_retention.core.planning.cutoff",
    ("sql", "eligibility"): "airflow_retention.core.sql.predicate",
    ("sql", "BLOCK_COUNT"): "airflow_retention.core.sql.catalog",
    ("catalog", "inspect_target"): "airflow_retention.core.db.catalog",
    ("catalog", "TargetInfo"): "airflow_retention.core.sql.target",
}


def test_every_promised_name_is_exported_and_is_its_modules_own() -> None:
    assert set(core.__all__) == PROMISED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stable path never warns
        for name in sorted(PROMISED):
            value = getattr(core, name)
            home = importlib.import_module(value.__module__)
            assert getattr(home, name) is value, name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        core.nothing_here  # noqa: B018


def test_docs_api_lists_every_promised_name() -> None:
    text = (REPO / "docs" / "api.md").read_text()
    table = re.search(r"## The stable core API(.*?)\n## ", text, re.S)
    assert table is not None, "docs/api.md has no section 'The stable core API'"
    listed = set(re.findall(r"^\| `(\w+)` \|", table.group(1), re.M))
    assert listed == PROMISED


_CHECK = r"""
import importlib, json, sys, warnings
out = {}
for (old, name) in json.loads(sys.argv[1]):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(f"airflow_retention.core.{old}")
        value = getattr(module, name)
        again = getattr(module, name)
    new = importlib.import_module(value.__module__) if hasattr(value, "__module__") else None
    out[f"{old}.{name}"] = {
        "same": again is value,
        "warnings": [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)],
    }
print(json.dumps(out))
"""


def test_the_old_module_paths_work_and_warn_naming_the_new_path() -> None:
    # A fresh interpreter: the forwarding modules warn once per name and process.
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, json.dumps(list(OLD_PATHS))],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    found = json.loads(done.stdout)
    for (old, name), new in OLD_PATHS.items():
        seen = found[f"{old}.{name}"]
        assert seen["same"], (old, name)
        (message,) = seen["warnings"]  # once, however often the name is read
        assert message.startswith(f"airflow_retention.core.{old}.{name} moved: import it from {new} "), message
        assert "until airflow-retention 0.3.0" in message
    for (old, name), new in OLD_PATHS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = getattr(importlib.import_module(f"airflow_retention.core.{old}"), name)
        target = importlib.import_module(new)
        assert getattr(target, name) is value


def test_an_unknown_name_of_an_old_path_is_an_attribute_error() -> None:
    planner = importlib.import_module("airflow_retention.core.planner")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        planner.no_such_thing  # noqa: B018
    sql = importlib.import_module("airflow_retention.core.sql")
    with pytest.raises(AttributeError):
        sql.no_such_thing  # noqa: B018
