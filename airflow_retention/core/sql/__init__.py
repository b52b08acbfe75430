"""Every statement run against a policy's target table, as text, with no connection: the facts it is
built from (:mod:`.target`), the one eligibility predicate every statement shares, the batch statements,
the planning, verification and partition statements. Identifiers are quoted here and nowhere else.

Until 0.3.0 the names of the module ``core.sql`` of 0.1.0 are forwarded, with a warning, to the modules
of this package that hold them now (:mod:`..moved`).
"""

from __future__ import annotations

from airflow_retention.core.moved import forwarding

# The names of 0.1.0's module airflow_retention.core.sql (only these: a submodule's name must not be
# looked up in the homes, or the import of a submodule would import all of them).
_OLD_NAMES = frozenset(
    (
        "MIN_KEY",
        "MAX_KEY",
        "target_from",
        "eligibility",
        "cutoff_value",
        "batch_statement_returns_counts",
        "batch_counts_tenants",
        "batch_walk_statement",
        "batch_statement",
        "TenantBatch",
        "tenant_batch",
        "tenants_in_batch_statement",
        "block_sample_statement",
        "eligible_spans_statement",
        "BLOCK_COUNT",
        "group_statement",
        "boundary_statement",
        "leftover_statement",
        "TENANT_CORRELATION",
        "null_timestamps_statement",
        "condition_probe",
        "RELATION_KIND",
        "PARTITION_TREE",
        "bound_check_statement",
        "PARTITION_STATE",
        "detach_statement",
        "lock_statement",
        "count_statement",
        "PARTITION_BOUNDS",
        "partition_census_statement",
        "drop_statement",
        "ineligible_exists_statement",
        "eligible_exists_statement",
        "TABLE_PRIVILEGES",
        "SCHEMA_STATE",
    )
)
_HOMES = (
    "airflow_retention.core.sql.predicate",
    "airflow_retention.core.sql.batches",
    "airflow_retention.core.sql.reads",
    "airflow_retention.core.sql.catalog",
    "airflow_retention.core.sql.partitions",
)


__getattr__ = forwarding(__name__, _HOMES, _OLD_NAMES)
