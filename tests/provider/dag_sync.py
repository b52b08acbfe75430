"""Write the test DAGs to the metadata database as the dag-processor does: their DAG rows, serialized DAGs
and assets (activated). Airflow 3.3's ``dag.test()`` does it itself for its DAG's folder; 3.0's writes
nothing, so a task with an asset outlet would fail there as inactive, and no DAG would be scheduled on it."""

from __future__ import annotations

from tests.conftest import DAGS_FOLDER


def sync_test_dags() -> None:
    from airflow.dag_processing.bundles.manager import DagBundlesManager

    from airflow_retention.compat import dagbag

    DagBundlesManager().sync_bundles_to_db()
    bag = dagbag(str(DAGS_FOLDER))
    try:  # Airflow 3.2+
        from airflow.dag_processing.dagbag import sync_bag_to_db
    except ImportError:  # Airflow 3.0, 3.1
        bag.sync_to_db("dags-folder", None)
    else:
        sync_bag_to_db(bag, "dags-folder", None)
