"""Exceptions, split by what a retry can do about them."""

from __future__ import annotations


class RetentionError(Exception):
    """Base class of every error raised by airflow-retention."""


class PolicyError(RetentionError, ValueError):
    """A policy is malformed; names the policy and the field. A retry cannot help."""

    def __init__(self, policy: str | None, field: str | None, problem: str) -> None:
        self.policy = policy
        self.field = field
        self.problem = problem
        where = []
        if policy:
            where.append(f"policy {policy!r}")
        if field:
            where.append(f"field {field!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {problem}" if prefix else problem)


class PermanentError(RetentionError):
    """The target or the ledger is in a state that a retry cannot change (missing table, bad column
    type, missing privilege, a cutoff in the future). Nothing was deleted."""


class RetryableError(RetentionError):
    """A transient database condition (lock or statement timeout, lost connection, deadlock,
    serialization failure). The failed batch was rolled back; a retry resumes from the ledger."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


class IncompleteRunError(RetentionError):
    """The ledger does not show every expected chunk of a run as complete."""

    def __init__(self, run_key: str, missing: list[str]) -> None:
        self.run_key = run_key
        self.missing = missing
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        super().__init__(f"run {run_key}: {len(missing)} expected chunk(s) not complete in the ledger: {shown}")


class TableMissing(PermanentError):
    """The policy's table is not in the database its connection reaches (or the role cannot see it): most
    often a connection pointed at the wrong database. The message names the database;
    :meth:`without_database` is the same message for readers who may not see connection details."""

    def __init__(self, where: str, table: object, conn_id: str, database: str) -> None:
        self.where, self.table, self.conn_id, self.database = where, table, conn_id, database
        super().__init__(
            f"{where}: table {table} does not exist in database {database!r} of connection {conn_id!r}"
            " (or this role cannot see it)"
        )

    def without_database(self) -> str:
        return (
            f"{self.where}: table {self.table} does not exist in the database of connection {self.conn_id!r}"
            " (or this role cannot see it)"
        )
