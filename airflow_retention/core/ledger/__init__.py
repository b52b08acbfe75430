"""The ledger, in the target database: its tables and migrations, and the records of runs, chunks,
batches, tenants and dead letters that make a retry harmless and a run's completion provable.

- ``ledger``: :class:`~airflow_retention.core.ledger.ledger.Ledger`, the one object callers use,
  composed of the parts below.
- ``records``: the plain records the ledger stores and returns (``RunRecord``, ``ChunkSpec``,
  ``Attempt``, ``DeadLetter``, ``MeasuredRate``) and the chunk label notation; no SQL.
- ``schema``: the schema version, the migrations, and ``LedgerSchema`` (``version``, ``ensure``).
- ``runs``: the ``runs`` table: registering, reading, completing, listing and pruning runs.
- ``chunks``: the ``chunks`` table: a run's plan, and each chunk's progress batch by batch.
- ``tenants``: per-tenant counts and cutoffs, and dead letters.
- ``history``: what past runs tell the next: measured rates, cleanup lag, vacuums, failed plans.
- ``slo``: the history behind a policy's cleanup SLO, and the database budget's state, read only.
- ``inflight``: chunks that a process may still be writing although no task runs them any more.
"""

# The names docs and DAG files imported from ``airflow_retention.core.ledger`` when it was one module.
from airflow_retention.core.ledger.ledger import Ledger
from airflow_retention.core.ledger.records import Attempt, ChunkSpec

__all__ = ["Attempt", "ChunkSpec", "Ledger"]
