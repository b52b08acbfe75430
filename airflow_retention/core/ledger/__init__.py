"""The ledger, in the target database: its tables and migrations, and the records of runs, chunks,
batches, tenants and dead letters that make a retry harmless and a run's completion provable.
"""
