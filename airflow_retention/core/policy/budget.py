"""``Budget``: how much of the database a purge may use, steered by the controller of
:mod:`airflow_retention.core.running.budget` (on by default), and the checks of its fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.policy.durations import parse_timeout_ms
from airflow_retention.core.policy.keys import setting, settings_kwargs

# YAML key -> attribute, for every key of a ``budget:`` mapping.
BUDGET_KEYS = {
    "enabled": "enabled",
    "period": "period_ms",
    "quiet_periods": "quiet_periods",
    "upper": "upper",
    "lower": "lower",
    "upper_latency": "upper_latency_ms",
    "lower_latency": "lower_latency_ms",
    "max_workers": "max_workers",
    "max_workers_per_tenant": "max_workers_per_tenant",
    "connection_reserve": "connection_reserve",
    "max_lock_waiters": "max_lock_waiters",
    "max_replica_lag": "max_replica_lag_ms",
    "max_archive_backlog": "max_archive_backlog",
    "yield_to_autovacuum": "yield_to_autovacuum",
    "max_wal_rate": "max_wal_rate",
    "min_duty": "min_duty",
    "on_unreadable": "on_unreadable",
    "ignore_databases": "ignore_databases",
}
ON_UNREADABLE = ("open", "closed")
# The range of ``min_duty``: the ladder's lowest duty cycle, and the lowest step the canary steps down to.
LOWEST_DUTY = 0.0025
HIGHEST_MIN_DUTY = 0.1


@dataclass(frozen=True)
class Budget:
    """How much of the database a purge may use: how many batches of all purges on the database run at
    once (``concurrency``) and the share of time a batch slot is busy (``duty cycle``), raised one step
    after ``quiet_periods`` observation periods with every pressure signal below its lower threshold,
    lowered one step in the period a signal crosses its upper one (docs/concepts.md, "The database
    budget").

    The foreground's latency is read as a canary: a one-row write committed with
    ``synchronous_commit = on``, timed, against its baseline measured before a run's first batch.

    :param enabled: False (YAML ``budget: false``) turns the controller off: chunks run at
        ``max_duty_cycle``, as many at once as Airflow starts, with only ``throttle``'s checks.
    :param period_ms: (YAML ``period``) the observation period: how often the signals are read.
    :param quiet_periods: periods in a row below every lower threshold before one step up.
    :param upper: the canary latency, as a multiple of its baseline, above which the budget steps down.
    :param lower: the multiple below which a period counts as quiet.
    :param upper_latency_ms: (YAML ``upper_latency``) an absolute upper threshold instead of ``upper``.
    :param lower_latency_ms: (YAML ``lower_latency``) an absolute lower threshold instead of ``lower``.
    :param max_workers: the most batches of all purges on the database at once.
    :param max_workers_per_tenant: the most of those batches in one tenant of one table at once (chunks of a
        tenant big enough to be cut into several), so that one busy tenant never takes every slot: ``"auto"``
        (half of ``max_workers``, rounded up) or a number; ``tenant_ceiling`` is the resolved value.
    :param connection_reserve: connections kept free for the application: the budget steps down when
        fewer are free, and never allows more batches than are free beyond it.
    :param max_lock_waiters: lock requests waiting on the target table above which the budget steps down.
    :param max_replica_lag_ms: (YAML ``max_replica_lag``) standby replay lag above which batches pause.
    :param max_archive_backlog: WAL segments waiting for ``archive_command`` above which batches pause.
    :param yield_to_autovacuum: step down while autovacuum works on the target table (recorded either way).
    :param max_wal_rate: the server's WAL rate (MB/s) above which the budget steps down while another
        session works: ``"auto"`` (the rate at which checkpoints stay timed, ``max_wal_size / (1 +
        checkpoint_completion_target) / checkpoint_timeout``: faster forces them back to back, and their
        fsyncs stall the application's commits), a number, or ``false`` (recorded only). Quiet below 70 % of it.
    :param min_duty: the floor: the lowest share of the time one batch may be busy, from 0.0025 (0.25 %)
        to 0.1. Only the WAL rate takes the budget below 10 %; this is how far.
    :param on_unreadable: ``"open"``: a signal this role cannot read is reported and ignored; ``"closed"``:
        it counts as above its upper threshold.
    :param ignore_databases: databases of the server whose sessions are not an application to yield to
        (Airflow's metadata database on the target's server, whose scheduler is always at work): they
        neither start the budget slow nor make the WAL rate count. The canary still measures whatever
        they cost.
    """

    enabled: bool = True
    period_ms: int = 2_000
    quiet_periods: int = 3
    upper: float = 2.0
    lower: float = 1.4
    upper_latency_ms: float | None = None
    lower_latency_ms: float | None = None
    max_workers: int = 4
    max_workers_per_tenant: int | str = "auto"
    connection_reserve: int = 10
    max_lock_waiters: int = 0
    max_replica_lag_ms: int = 30_000
    max_archive_backlog: int = 42
    yield_to_autovacuum: bool = False
    max_wal_rate: float | str | None = "auto"
    min_duty: float = 0.005
    on_unreadable: str = "open"
    ignore_databases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in _validated(self).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_value(cls, value: object) -> Budget:
        """A ``Budget`` from YAML: a mapping of its keys, ``true``/``false``, or None (the defaults)."""
        if value is None or value is True:
            return cls()
        if value is False or value == "off":
            return cls(enabled=False)
        if isinstance(value, Budget):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping of budget settings, true or false, got {value!r}")
        return cls(**settings_kwargs(value, BUDGET_KEYS))

    @property
    def tenant_ceiling(self) -> int:
        """How many batches of one tenant may run at once: ``max_workers_per_tenant`` resolved, at most
        ``max_workers``."""
        if self.max_workers_per_tenant == "auto":
            return -(-self.max_workers // 2)
        return min(int(self.max_workers_per_tenant), self.max_workers)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, attr) for k, attr in BUDGET_KEYS.items()}
        out["ignore_databases"] = list(self.ignore_databases)  # YAML and JSON have lists, not tuples
        return out


def _validated(b: Budget) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(b.enabled, bool):
        raise ValueError(f"enabled: must be true or false, got {b.enabled!r}")
    if not isinstance(b.yield_to_autovacuum, bool):
        raise ValueError(f"yield_to_autovacuum: must be true or false, got {b.yield_to_autovacuum!r}")
    out["period_ms"] = setting("period", parse_timeout_ms, b.period_ms)
    if out["period_ms"] < 100:
        raise ValueError(f"period: must be at least 100ms, got {b.period_ms!r}")
    out["max_replica_lag_ms"] = setting("max_replica_lag", parse_timeout_ms, b.max_replica_lag_ms)
    for name, low, high in (
        ("quiet_periods", 1, 1000),
        ("max_workers", 1, 64),
        ("connection_reserve", 0, 10_000),
        ("max_lock_waiters", 0, 10_000),
        ("max_archive_backlog", 0, 1_000_000),
    ):
        value = getattr(b, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name}: must be an integer from {low} to {high}, got {value!r}")
    for name in ("upper", "lower"):
        value = getattr(b, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 100:
            raise ValueError(f"{name}: must be a multiple of the baseline latency from 1 to 100, got {value!r}")
        out[name] = float(value)
    if out["lower"] >= out["upper"]:
        raise ValueError(f"lower ({b.lower!r}) must be below upper ({b.upper!r}): the band between is the hysteresis")
    for name, key in (("upper_latency_ms", "upper_latency"), ("lower_latency_ms", "lower_latency")):
        value = getattr(b, name)
        if value is not None:
            out[name] = float(setting(key, parse_timeout_ms, value))
    if (b.upper_latency_ms is None) != (b.lower_latency_ms is None):
        raise ValueError("upper_latency and lower_latency go together: give both or neither")
    if b.upper_latency_ms is not None and out["lower_latency_ms"] >= out["upper_latency_ms"]:
        raise ValueError("lower_latency must be below upper_latency: the band between is the hysteresis")
    out["max_wal_rate"] = _wal_rate(b.max_wal_rate)
    if (
        isinstance(b.min_duty, bool)
        or not isinstance(b.min_duty, (int, float))
        or not LOWEST_DUTY <= b.min_duty <= HIGHEST_MIN_DUTY
    ):
        raise ValueError(
            f"min_duty: must be a share of the time from {LOWEST_DUTY:g} to {HIGHEST_MIN_DUTY:g}, got {b.min_duty!r}"
        )
    out["min_duty"] = float(b.min_duty)
    per_tenant = b.max_workers_per_tenant
    if per_tenant != "auto" and (
        isinstance(per_tenant, bool) or not isinstance(per_tenant, int) or not 1 <= per_tenant <= 64
    ):
        raise ValueError(f"max_workers_per_tenant: must be 'auto' or an integer from 1 to 64, got {per_tenant!r}")
    if b.on_unreadable not in ON_UNREADABLE:
        raise ValueError(f"on_unreadable: must be 'open' or 'closed', got {b.on_unreadable!r}")
    names = b.ignore_databases
    if (
        isinstance(names, str)
        or not isinstance(names, (list, tuple))
        or not all(isinstance(n, str) and n.strip() for n in names)
    ):
        raise ValueError(f"ignore_databases: must be a list of database names, got {names!r}")
    out["ignore_databases"] = tuple(dict.fromkeys(names))
    return out


def _wal_rate(value: object) -> float | str | None:
    if value is None or value is False or value == "off":
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100_000:
        raise ValueError(f"max_wal_rate: must be 'auto', false or MB/s above 0, got {value!r}")
    return float(value)
