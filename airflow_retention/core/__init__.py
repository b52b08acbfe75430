"""The Airflow-free core of airflow-retention: policy, SQL, ledger, planner and chunk engine.

Everything under this package works on a plain DB-API connection (psycopg2 or psycopg 3), so it can be
tested and reused without Airflow.
"""
