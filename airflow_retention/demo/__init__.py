"""The end-to-end demo and the set-up it shares with the tests: a PostgreSQL to use, an Airflow home,
example tables with a realistic shape."""
