"""The ledger: runs and chunks of every purge, kept in the target database.

It lives next to the data because an Airflow 3 task cannot reach the metadata database, and because
a batch's ledger update must commit in the same transaction as its DELETE. :class:`Ledger` is the one
object callers use; its statements are grouped by table in the modules it is composed of (see the
package's docstring). The columns are documented in ``docs/ledger.md``.
"""

from __future__ import annotations

from airflow_retention.core.ledger.budget import LedgerBudget
from airflow_retention.core.ledger.chunks import LedgerChunks
from airflow_retention.core.ledger.history import LedgerHistory
from airflow_retention.core.ledger.runs import LedgerRuns
from airflow_retention.core.ledger.slo import LedgerSlo
from airflow_retention.core.ledger.tenants import LedgerTenants


class Ledger(LedgerRuns, LedgerChunks, LedgerTenants, LedgerHistory, LedgerBudget, LedgerSlo):
    """Statements on the ledger tables of one schema: ``Ledger(schema="retention")``.

    :param schema: the schema that holds the ledger tables (created by :meth:`ensure` if need be).
    """
