"""``Throttle``: when the engine pauses between batches so that a purge yields to a busy database, and
the checks of its fields (the probe query among them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.policy.durations import parse_timeout_ms
from airflow_retention.core.policy.keys import THROTTLE_KEYS, setting, settings_kwargs


@dataclass(frozen=True)
class Throttle:
    """When the engine pauses between batches, so that a purge yields to a busy database.

    Every check runs between two batches, outside their transactions. While any signal is above its
    threshold the engine sleeps (``backoff``, doubling with jitter up to a minute) and checks again; once
    it has paused ``give_up_after`` in one attempt it stops the chunk as retryable: its committed batches
    stay, and Airflow's retry resumes it later.

    :param max_replica_lag_ms: (YAML ``max_replica_lag``) the largest replay lag of any standby
        (``pg_stat_replication.replay_lag`` on the primary) before pausing; ``"30s"`` or ms as int.
        None: not checked. The role needs ``pg_monitor`` to see the lag.
    :param max_lock_waiters: lock requests waiting on the target table (``pg_locks``, not granted) before
        pausing, e.g. a migration's ``ALTER TABLE`` queued behind the purge. None: not checked.
    :param probe: trusted SQL of the DAG author that returns one number (say, active sessions); it is
        compared with ``probe_max``.
    :param probe_max: the probe's largest acceptable value.
    :param backoff_ms: (YAML ``backoff``) the first pause.
    :param give_up_after_ms: (YAML ``give_up_after``) total pause of one attempt after which the chunk
        stops as retryable.
    """

    max_replica_lag_ms: int | None = None
    max_lock_waiters: int | None = None
    probe: str | None = None
    probe_max: float | None = None
    backoff_ms: int = 1_000
    give_up_after_ms: int = 600_000

    def __post_init__(self) -> None:
        for name, value in _validated_throttle(self).items():
            object.__setattr__(self, name, value)

    @property
    def enabled(self) -> bool:
        return self.max_replica_lag_ms is not None or self.max_lock_waiters is not None or self.probe is not None

    @classmethod
    def from_value(cls, value: object) -> Throttle:
        """A ``Throttle`` from its YAML mapping (``max_replica_lag``, ``backoff``, ...)."""
        if value is None:
            return cls()
        if isinstance(value, Throttle):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping of throttle settings, got {value!r}")
        return cls(**settings_kwargs(value, THROTTLE_KEYS))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, attr) for k, attr in THROTTLE_KEYS.items()}


def _validated_throttle(t: Throttle) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if t.max_replica_lag_ms is not None:
        out["max_replica_lag_ms"] = setting("max_replica_lag", parse_timeout_ms, t.max_replica_lag_ms)
    if t.max_lock_waiters is not None:
        if isinstance(t.max_lock_waiters, bool) or not isinstance(t.max_lock_waiters, int) or t.max_lock_waiters < 0:
            raise ValueError(f"max_lock_waiters: must be a non-negative integer, got {t.max_lock_waiters!r}")
    if (t.probe is None) != (t.probe_max is None):
        raise ValueError("probe and probe_max go together: give both or neither")
    if t.probe is not None:
        out["probe"] = setting("probe", check_probe, t.probe)
        if isinstance(t.probe_max, bool) or not isinstance(t.probe_max, (int, float)):
            raise ValueError(f"probe_max: must be a number, got {t.probe_max!r}")
        out["probe_max"] = float(t.probe_max)
    out["backoff_ms"] = setting("backoff", parse_timeout_ms, t.backoff_ms)
    out["give_up_after_ms"] = setting("give_up_after", parse_timeout_ms, t.give_up_after_ms)
    return out


def check_probe(probe: object) -> str:
    """A throttle probe is one trusted query of the DAG author, run as written between batches."""
    if not isinstance(probe, str) or not probe.strip():
        raise ValueError("must be a non-empty SQL query returning one number")
    if ";" in probe.strip().rstrip(";"):
        raise ValueError("must be one query: ';' is not allowed")
    return probe.strip().rstrip(";")
