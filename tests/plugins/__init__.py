"""Tests of the Retention view (the Airflow UI plugin)."""
