"""``airflow-retention``: the ledger and plans of retention policies from a terminal, without Airflow.

    airflow-retention [--policies PATH] [--dsn DSN] [--json] status [POLICY ...]
    airflow-retention plan POLICY --date 2026-06-06
    airflow-retention verify POLICY --date 2026-06-06
    airflow-retention init-ledger

See ``docs/cli.md``.
"""

from __future__ import annotations

from airflow_retention.cli.main import main

__all__ = ["main"]
