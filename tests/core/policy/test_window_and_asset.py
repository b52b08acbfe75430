"""The fields of issue 33: ``cleanup_window`` (a deadline on Airflow 3.1+, a cleanup SLO later) and ``asset``
(the table as an Airflow asset). Each checked with its error naming the field, read from YAML, and written
back by ``policy_to_dict``. No database."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from airflow_retention.core.policy.loading import load_policies, policy_to_dict
from airflow_retention.core.policy.model import RetentionPolicy

from .helpers import build, refused


@pytest.mark.parametrize(
    ("given", "window"),
    [
        ("24h", timedelta(hours=24)),
        ("1 day", timedelta(days=1)),
        ("PT36H", timedelta(hours=36)),
        ("1 day 12 hours", timedelta(hours=36)),
        ("90 min", timedelta(minutes=90)),
        ("P7D", timedelta(days=7)),
        (timedelta(hours=6), timedelta(hours=6)),
    ],
)
def test_cleanup_window_reads_a_span_of_time(given: object, window: timedelta) -> None:
    policy = build(cleanup_window=given)
    assert policy.cleanup_window == window
    assert RetentionPolicy.from_dict(policy_to_dict(policy)) == policy


def test_cleanup_window_defaults_to_none() -> None:
    assert build().cleanup_window is None
    assert policy_to_dict(build())["cleanup_window"] is None


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("1 month", "months and years have no fixed length"),
        ("1 year", "months and years have no fixed length"),
        (86400, "must be a duration such as '24h'"),  # seconds or hours? refused
        (True, "must be a duration"),
        ("30s", "from 1 minute to 366 days"),
        ("400 days", "from 1 minute to 366 days"),
        (timedelta(milliseconds=90_500), "whole seconds"),
        ("soon", "cannot read 'soon' as a duration"),
    ],
)
def test_cleanup_window_refuses_what_is_not_a_fixed_span(given: object, said: str) -> None:
    assert said in str(refused("cleanup_window", cleanup_window=given))


def test_asset_true_needs_a_schema_to_name_the_table() -> None:
    assert build(asset=True).asset is True
    assert build(asset=False).asset is None and build().asset is None
    error = refused("asset", asset=True, table="events")
    assert "needs a schema-qualified table" in str(error) and "public.events" in str(error)


def test_an_asset_uri_is_normalised_as_airflow_does() -> None:
    assert (
        build(asset="postgresql://DB.example/app/public/events").asset == "postgres://db.example:5432/app/public/events"
    )
    odd = build(table='"Tenant Data"."order"', asset="postgres://h:6432/app/Tenant%20Data/order").asset
    assert odd == "postgres://h:6432/app/Tenant%20Data/order"


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (1, "must be true, false or a postgres://"),
        ("s3://bucket/events", "is not a postgres://host:port/database/schema/table URI"),
        ("postgres://h:5432/app/events", "the path must be /database/schema/table"),
        ("postgres://h:5432/app/other/events", "names table other.events, not the policy's table public.events"),
        ("postgres://h:5432/app/public/orders", "not the policy's table public.events"),
        ("postgres://u:secret@h/app/public/events", "no user, password, query or fragment"),
        ("postgres://h:port/app/public/events", "Port could not be cast"),
    ],
)
def test_asset_refuses_a_uri_of_another_table_or_form(given: object, said: str) -> None:
    assert said in str(refused("asset", asset=given))


def test_both_fields_come_from_yaml_and_go_back(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(
        """
defaults: {conn_id: target, key_column: id, timestamp_column: created_at, cleanup_window: 6h}
policies:
  - {name: events, table: public.events, retention: 30 days, asset: true, cleanup_window: 2 days}
  - {name: orders, table: shop.orders, retention: 1 year, asset: "postgres://db:5432/app/shop/orders"}
  - {name: plain, table: public.plain, retention: 1 day, asset: false}
"""
    )
    events, orders, plain = load_policies(path)
    assert (events.asset, events.cleanup_window) == (True, timedelta(days=2))
    assert (orders.asset, orders.cleanup_window) == ("postgres://db:5432/app/shop/orders", timedelta(hours=6))
    assert (plain.asset, plain.cleanup_window) == (None, timedelta(hours=6))
    for policy in (events, orders, plain):
        written = policy_to_dict(policy)
        assert RetentionPolicy.from_dict(written) == policy
    assert policy_to_dict(events)["cleanup_window"] == "2 days"
    assert policy_to_dict(orders)["cleanup_window"] == "6 hours"


def test_the_dag_doc_shows_them_only_when_set() -> None:
    plain = build().describe()
    assert "cleanup window" not in plain and "| asset |" not in plain
    text = build(cleanup_window="36h", asset=True).describe()
    assert "| cleanup window | complete 1 day 12 hours after the run's date |" in text
    assert "postgres://host:port/database/schema/table" in text
