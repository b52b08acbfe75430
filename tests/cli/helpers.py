"""Running the command in-process and writing the policies file of a test schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_retention.cli import main

from ..core.helpers import CUTOFF, policy_data

__all__ = ["policy_data"]

# The run whose cutoff is tests.core.helpers.CUTOFF: the policy keeps 30 days.
RUN_DATE = (CUTOFF + timedelta(days=30)).isoformat()


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    """``main(argv)`` in this process, with stdout and stderr captured."""
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def write_policies(path: Path, *policies: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({"policies": list(policies)}, sort_keys=False))
    return path
