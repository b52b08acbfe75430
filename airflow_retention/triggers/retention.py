"""``RetentionCompleteTrigger``: waits in the triggerer until the ledger shows a run's chunks complete."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class RetentionCompleteTrigger(BaseTrigger):
    """Poll the ledger every ``poll_interval`` seconds; fire ``complete`` when every expected chunk is
    complete, or ``timeout`` with the missing chunk keys once ``timeout`` seconds have passed, or
    ``recheck`` (with the seconds ``remaining`` of the timeout) after ``recheck_after`` seconds, for the
    sensor to look at what the triggerer cannot see (the chunk tasks' states) and defer again.

    :param policy: the policy as a mapping (``RetentionPolicy.from_dict`` input), serialisable.
    :param run_key: the run to wait for.
    :param expected_keys: the chunk keys the planner handed out.
    :param poll_interval: seconds between checks.
    :param timeout: seconds after which the trigger gives up.
    :param recheck_after: seconds after which to hand back to the sensor; None never.
    """

    def __init__(
        self,
        *,
        policy: dict[str, Any],
        run_key: str,
        expected_keys: Sequence[str],
        poll_interval: float = 30.0,
        timeout: float = 3600.0,
        started_at: float | None = None,
        recheck_after: float | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.run_key = run_key
        self.expected_keys = list(expected_keys)
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.started_at = started_at if started_at is not None else time.time()
        self.recheck_after = recheck_after

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "policy": self.policy,
                "run_key": self.run_key,
                "expected_keys": self.expected_keys,
                "poll_interval": self.poll_interval,
                "timeout": self.timeout,
                "started_at": self.started_at,
                "recheck_after": self.recheck_after,
            },
        )

    def _check(self) -> tuple[bool, list[str]]:
        from airflow_retention.core.policy.model import RetentionPolicy
        from airflow_retention.hooks.retention import RetentionHook

        hook = RetentionHook(policy=RetentionPolicy.from_dict(self.policy))
        verification = hook.verify(self.run_key, self.expected_keys)
        return verification.ok, verification.missing

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            ok, missing = await asyncio.to_thread(self._check)
            if ok:
                yield TriggerEvent({"status": "complete", "run_key": self.run_key})
                return
            elapsed = time.time() - self.started_at
            if elapsed >= self.timeout:
                yield TriggerEvent({"status": "timeout", "run_key": self.run_key, "missing": missing})
                return
            if self.recheck_after is not None and elapsed >= self.recheck_after:
                remaining = self.timeout - elapsed
                yield TriggerEvent({"status": "recheck", "run_key": self.run_key, "remaining": remaining})
                return
            self.log.info("run %s: %d chunk(s) not complete yet", self.run_key, len(missing))
            await asyncio.sleep(self.poll_interval)
