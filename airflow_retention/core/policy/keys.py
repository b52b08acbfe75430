"""The YAML spelling of a policy: the keys named differently from their Python attributes, the required
ones, and the hint that names the key an unknown one was meant to be."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

REQUIRED_KEYS = ("name", "conn_id", "table", "timestamp_column", "retention")
# YAML key -> attribute of ``RetentionPolicy``, for the keys whose attribute carries its unit.
RENAMED_KEYS = {
    "lock_timeout": "lock_timeout_ms",
    "statement_timeout": "statement_timeout_ms",
    "retry_delay": "retry_delay_ms",
    "target_batch_time": "target_batch_ms",
    "target_chunk_time": "target_chunk_ms",
}
# YAML key -> attribute of ``Throttle``: every key of a ``throttle:`` mapping.
THROTTLE_KEYS = {
    "max_replica_lag": "max_replica_lag_ms",
    "max_lock_waiters": "max_lock_waiters",
    "probe": "probe",
    "probe_max": "probe_max",
    "backoff": "backoff_ms",
    "give_up_after": "give_up_after_ms",
}


def unknown_key_hint(key: object, known: Iterable[str]) -> str:
    """The end of an unknown-key message: the known key closest to a typo (``: did you mean
    'condition'?``), or, when none is close, every known key (a list of 40 hides the one meant)."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    if close:
        return f": did you mean {close[0]!r}?"
    return f" (known keys: {', '.join(sorted(known))})"


def settings_kwargs(value: Mapping[Any, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    """A nested mapping of settings (``throttle:``, ``budget:``) as keyword arguments by attribute; an
    unknown key fails naming the known one closest to it."""
    unknown = sorted(set(value) - set(keys), key=str)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}{unknown_key_hint(unknown[0], keys)}")
    return {keys[k]: v for k, v in value.items()}


def setting(name: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)``, its error prefixed with the setting's YAML key."""
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
