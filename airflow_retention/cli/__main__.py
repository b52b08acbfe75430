"""``python -m airflow_retention.cli``: the same as the ``airflow-retention`` command."""

from __future__ import annotations

import sys

from airflow_retention.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
