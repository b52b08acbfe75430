"""Every statement run against a policy's target table, as text, with no connection: the facts it is
built from (:mod:`.target`), the one eligibility predicate every statement shares, the batch statements,
the planning, verification and partition statements. Identifiers are quoted here and nowhere else.
"""
