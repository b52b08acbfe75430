"""What a policy says, with no database: the policy (:mod:`.model`), the checks of its fields
(:mod:`.validation`), its throttle (:mod:`.throttle`), its YAML keys (:mod:`.keys`), reading and writing
policies files (:mod:`.loading`), durations (:mod:`.durations`) and SQL identifiers (:mod:`.identifiers`).
Everything below builds on a :class:`~.model.RetentionPolicy` that has passed these checks.
"""

# The names docs and DAG files imported from ``airflow_retention.core.policy`` when it was one module.
from airflow_retention.core.policy.loading import load_policies, load_policies_lenient, policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.policy.throttle import Throttle
from airflow_retention.core.policy.validation import check_condition

__all__ = ["RetentionPolicy", "Throttle", "check_condition", "load_policies", "load_policies_lenient", "policy_to_dict"]
