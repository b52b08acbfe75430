"""What a policy says, with no database: its fields and their checks (:mod:`.model`), durations
(:mod:`.durations`) and SQL identifiers (:mod:`.identifiers`). Everything below builds on a
:class:`~.model.RetentionPolicy` that has passed these checks.
"""
