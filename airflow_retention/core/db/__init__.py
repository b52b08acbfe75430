"""The database: the DB-API layer that makes psycopg2 and psycopg 3 behave alike (:mod:`.dbapi`), the
catalog checks of a target table (:mod:`.catalog`), pg_partman's configuration (:mod:`.partman`) and
moving a relation to another schema (:mod:`.move`).
"""
