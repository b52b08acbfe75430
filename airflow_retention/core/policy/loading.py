"""Policies from a YAML file, and back: :func:`load_policies` (strict), :func:`load_policies_lenient` (the
good policies and the errors of the bad ones, with :func:`problem_dag_ids` saying where each error is
shown), and :func:`policy_to_dict`, the mapping ``RetentionPolicy.from_dict`` reads back."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow_retention.core.errors import PolicyError
from airflow_retention.core.policy.budget import Budget
from airflow_retention.core.policy.durations import Retention, format_window
from airflow_retention.core.policy.identifiers import TableName
from airflow_retention.core.policy.keys import RENAMED_KEYS, unknown_key_hint
from airflow_retention.core.policy.model import DAG_ID_PREFIX, RetentionPolicy
from airflow_retention.core.policy.throttle import Throttle
from airflow_retention.core.policy.validation import NAME_PATTERN

INVALID_POLICIES_DAG_ID = f"{DAG_ID_PREFIX}invalid_policies"


def load_policies(path: str | Path) -> list[RetentionPolicy]:
    """Load every policy of a YAML file; raise on the first bad one."""
    policies, errors = load_policies_lenient(path)
    if errors:
        raise errors[0]
    return policies


def problem_dag_ids(valid_names: Iterable[str], problems: Iterable[PolicyError]) -> dict[str, list[str]]:
    """Where each invalid policy is shown: its usual DAG id ``retention_<name>``, or, for a problem without a
    usable name (an unreadable file, an entry that is not a mapping or has no valid name, a second policy of
    one name), ``retention_invalid_policies``. The DAG file builds a failing DAG under each id; the
    Retention view shows each problem to the users who may read that DAG.

    :param valid_names: the names of the policies that are valid (their ids are taken).
    :param problems: the errors of the invalid policies.
    :returns: the problems' messages by DAG id, in the order given.
    """
    taken = {f"{DAG_ID_PREFIX}{name}" for name in valid_names}
    bad: dict[str, list[str]] = {}
    for problem in problems:
        name = problem.policy
        dag_id = f"{DAG_ID_PREFIX}{name}" if isinstance(name, str) and NAME_PATTERN.match(name) else None
        if dag_id is None or dag_id in taken:  # no usable name, or the id of a valid policy of the same name
            dag_id = INVALID_POLICIES_DAG_ID
        bad.setdefault(dag_id, []).append(str(problem))
    if INVALID_POLICIES_DAG_ID in bad and INVALID_POLICIES_DAG_ID in taken:  # a valid policy named invalid_policies
        bad[f"{INVALID_POLICIES_DAG_ID}_entries"] = bad.pop(INVALID_POLICIES_DAG_ID)
    return bad


def load_policies_lenient(path: str | Path) -> tuple[list[RetentionPolicy], list[PolicyError]]:
    """Load a YAML policies file, keeping the good policies and the errors of the bad ones.

    The file holds ``policies:`` (a list of mappings) and an optional ``defaults:`` mapping merged under
    each policy. A file that cannot be read at all raises ``PolicyError``.
    """
    import yaml

    source = Path(path)
    try:
        doc = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError(None, None, f"cannot read policies file {source}: {exc}") from exc
    # Unknown keys first: "polices:" is a typo of "policies", not a file without a policies list.
    unknown = sorted(set(doc) - {"policies", "defaults"}, key=str) if isinstance(doc, dict) else []
    if unknown:
        hint = unknown_key_hint(unknown[0], ("policies", "defaults"))
        raise PolicyError(None, unknown[0], f"unknown top-level key in {source}{hint}")
    if not isinstance(doc, dict) or not isinstance(doc.get("policies"), list):
        raise PolicyError(None, "policies", f"{source} must hold a mapping with a 'policies' list")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise PolicyError(None, "defaults", "must be a mapping")
    policies: list[RetentionPolicy] = []
    errors: list[PolicyError] = []
    seen: set[str] = set()
    for index, entry in enumerate(doc["policies"]):
        if not isinstance(entry, dict):
            errors.append(PolicyError(f"#{index + 1}", None, "each policy must be a mapping"))
            continue
        try:
            policy = RetentionPolicy.from_dict(entry, defaults=defaults)
        except PolicyError as exc:
            errors.append(exc)
            continue
        if policy.name in seen:
            errors.append(PolicyError(policy.name, "name", "is used by more than one policy"))
            continue
        seen.add(policy.name)
        policies.append(policy)
    return policies, errors


def policy_to_dict(policy: RetentionPolicy) -> dict[str, Any]:
    """The policy as a plain mapping that ``RetentionPolicy.from_dict`` reads back (a trigger's
    serialised form, logs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, (TableName, Retention)):
            value = str(value)
        elif f.name == "tenant_retention":
            value = {tenant: str(duration) for tenant, duration in value}
        elif isinstance(value, (Throttle, Budget)):
            value = value.to_dict()
        elif isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, timedelta):
            value = format_window(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    for yaml_key, attr in RENAMED_KEYS.items():
        out[yaml_key] = out.pop(attr)
    return out
