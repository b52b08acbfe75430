"""Chunks that a process may still be writing although no task runs them any more.

The verify step runs once every chunk task has ended, so as a rule nothing writes to the run's chunks
when it looks, and it decides at once. The exception is a chunk task that the scheduler failed while
its process went on (a lost heartbeat: a zombie): such a chunk shows in the ledger as running, with no
error recorded, and a batch committed moments ago. Only then is it worth waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import ChunkSpec

# A live chunk commits a batch every fraction of a second (``target_batch_time``), or pauses a few
# seconds under database pressure; a minute without a batch means its process is gone.
STILL_WRITING_WINDOW = timedelta(seconds=60)


def chunks_still_writing(
    conn: Any,
    ledger: Ledger,
    run_key: str,
    chunk_keys: Sequence[str],
    window: timedelta = STILL_WRITING_WINDOW,
) -> list[ChunkSpec]:
    """The chunks among ``chunk_keys`` that are not complete, have no error recorded since their last
    batch, and were written to (a batch, a start, a detach begun) less than ``window`` ago by the
    database's clock."""
    wanted = set(chunk_keys)
    now = dbapi.fetch_all(conn, "SELECT clock_timestamp()")[0][0]
    writing = []
    for row in ledger.chunk_rows(conn, run_key):
        if row["chunk_key"] not in wanted or row["state"] != "running" or row["last_error"] is not None:
            continue
        touched = [t for t in (row["last_batch_at"], row["first_started_at"], row["action_started_at"]) if t]
        if touched and now - max(touched) < window:
            writing.append(ChunkSpec.of_row(row))
    return writing
