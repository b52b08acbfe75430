"""The Retention view in the Airflow UI: an Airflow 3 plugin (a FastAPI app and a navigation entry) that shows,
per policy, the last runs, a chart of rows deleted and cleanup lag, one run's chunks and the missed days, read
from the ledgers through the policies' connections.

:mod:`.data` reads the ledgers, :mod:`.chart` and :mod:`.render` draw HTML, :mod:`.app` serves it to logged-in
users, :mod:`.retention_view` registers it with Airflow (entry point ``airflow.plugins``).
"""
