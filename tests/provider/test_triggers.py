"""The deferrable sensor's trigger polls the real ledger."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.policy.loading import load_policies, policy_to_dict
from tests.provider.conftest import TEST_POLICIES, utc

pytestmark = pytest.mark.airflow


def first_event(trigger: Any) -> dict[str, Any]:
    async def take() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    return asyncio.run(asyncio.wait_for(take(), timeout=30))


def test_trigger_times_out_naming_missing_chunks_then_fires_when_complete(target: Any) -> None:
    from airflow_retention.core.planning.planner import plan_run
    from airflow_retention.core.running.engine import run_chunk
    from airflow_retention.triggers.retention import RetentionCompleteTrigger

    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_orders")
    cutoff = freeze_cutoff(policy, utc("2026-02-05"))
    plan = plan_run(target, policy, cutoff)
    keys = [c.key for c in plan.chunks]
    kwargs = {"policy": policy_to_dict(policy), "run_key": plan.run_key, "expected_keys": keys}

    waiting = RetentionCompleteTrigger(**kwargs, poll_interval=0.2, timeout=0.5)
    classpath, serialized = waiting.serialize()
    assert classpath == "airflow_retention.triggers.retention.RetentionCompleteTrigger"
    event = first_event(RetentionCompleteTrigger(**serialized))
    assert event["status"] == "timeout"
    assert event["missing"] == keys

    for chunk in plan.chunks:
        run_chunk(target, policy, cutoff, chunk)
    event = first_event(RetentionCompleteTrigger(**kwargs, poll_interval=0.2, timeout=5))
    assert event == {"status": "complete", "run_key": plan.run_key}


def test_trigger_hands_back_to_the_sensor_to_recheck_the_chunk_tasks(target: Any) -> None:
    from airflow_retention.core.planning.planner import plan_run
    from airflow_retention.triggers.retention import RetentionCompleteTrigger

    policy = next(p for p in load_policies(TEST_POLICIES) if p.name == "t_orders")
    plan = plan_run(target, policy, freeze_cutoff(policy, utc("2026-02-05")))
    trigger = RetentionCompleteTrigger(
        policy=policy_to_dict(policy),
        run_key=plan.run_key,
        expected_keys=[c.key for c in plan.chunks],
        poll_interval=0.2,
        timeout=30,
        recheck_after=0.5,
    )
    event = first_event(RetentionCompleteTrigger(**trigger.serialize()[1]))
    assert (event["status"], event["run_key"]) == ("recheck", plan.run_key)
    assert 25 < event["remaining"] < 30  # the rest of the timeout, for the sensor's next deferral
