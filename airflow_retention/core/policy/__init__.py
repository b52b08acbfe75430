"""What a policy says, with no database: the policy (:mod:`.model`), the checks of its fields
(:mod:`.validation`), its throttle (:mod:`.throttle`), its YAML keys (:mod:`.keys`), reading and writing
policies files (:mod:`.loading`), durations (:mod:`.durations`) and SQL identifiers (:mod:`.identifiers`).
Everything below builds on a :class:`~.model.RetentionPolicy` that has passed these checks.
"""
