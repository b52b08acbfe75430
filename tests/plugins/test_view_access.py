"""Who sees what in the Retention view, over HTTP against the real api-server (tests/plugins/conftest.py):
every route of the app, as a client without a login, as ``outsider`` (may read no DAG), as ``limited`` (may
read some retention DAGs and no connection) and as ``admin``.

The routes are enumerated from the app itself: a route added without a request here fails
:func:`test_every_route_of_the_app_is_tested`.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from html import unescape
from pathlib import Path
from typing import Any

import pytest
import requests

from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.plugins.app import PUBLIC_PATHS, create_app
from tests.deployment.harness import Deployment

from .conftest import BROKEN_CONN, BROKEN_DB, BROKEN_USER, LIMITED_DAGS
from .helpers import CHUNK_ERROR, Seeded, connection_details, shown_policies, shown_problems, view_policy_data

pytestmark = pytest.mark.scheduler

ALL_POLICIES = {"events_purge", "unreachable", "missing_table", "stalled"}
ALL_PROBLEMS = {"retention_bad_retention", "retention_invalid_policies"}
FIRST = datetime(2024, 7, 1, tzinfo=timezone.utc)
NAMES = (("ours", "ours_conn"), ("theirs", "theirs_conn"))


def route_requests(seeded: Seeded) -> dict[str, list[dict[str, str]]]:
    """The query strings each route of the app is requested with."""
    return {
        "/": [{}],
        "/run": [
            {"policy": "events_purge", "key": seeded.partial},  # readable by admin only; its ledger answers
            {"policy": "unreachable", "key": seeded.partial},  # readable by limited; its database refuses
            {},  # no parameters at all
        ],
        "/icon.svg": [{}],
    }


def get(deployment: Deployment, path: str, params: dict[str, str], headers: dict[str, str]) -> requests.Response:
    return requests.get(f"{deployment.base_url}/retention{path}", params=params, headers=headers, timeout=60)


def bearer(deployment: Deployment, user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {deployment.token_for(user)}"}


def ledger_markers(seeded: Seeded) -> list[str]:
    """What no page may show a user who may not read events_purge's DAG: its runs and chunks (its name only
    where a page repeats the name asked for; its table is the unreachable policy's too)."""
    return [seeded.partial, *seeded.complete, seeded.failing_chunk, CHUNK_ERROR]


def all_connection_details(target_dsn: str) -> list[str]:
    return [*connection_details(target_dsn), *connection_details(BROKEN_CONN)]


def policies_file(deployment: Deployment) -> str:
    return deployment.env["AIRFLOW_RETENTION_POLICIES"]


def assert_absent(body: str, forbidden: list[str], what: str) -> None:
    found = [f for f in forbidden if f in body]
    assert not found, f"{what}: the page shows {found}\n{body[:2000]}"


def test_every_route_of_the_app_is_tested(view_seeded: Seeded) -> None:
    routes = {route.path for route in create_app().routes}  # type: ignore[attr-defined]
    assert routes == set(route_requests(view_seeded)), "a route of the app has no request in these tests"
    assert set(PUBLIC_PATHS) <= routes


def test_without_a_login_every_route_but_the_icon_is_refused(
    view_deployment: Deployment, view_seeded: Seeded, view_target: str
) -> None:
    forbidden = [*ledger_markers(view_seeded), *all_connection_details(view_target), policies_file(view_deployment)]
    forbidden += ["events_purge", "unreachable", "bad_retention", "retention_invalid_policies"]
    anonymous = [
        ("nothing", {}),
        ("an invalid cookie", {"Cookie": "_token=not-a-token"}),
        ("an invalid bearer token", {"Authorization": "Bearer not-a-token"}),
    ]
    for path, queries in route_requests(view_seeded).items():
        for params in queries:
            for what, headers in anonymous:
                response = get(view_deployment, path, params, headers)
                where = f"{path} {params} with {what}"
                if path in PUBLIC_PATHS:
                    assert response.status_code == 200, where
                    assert response.headers["content-type"].startswith("image/svg+xml"), where
                else:
                    assert response.status_code == 401, (where, response.status_code, response.text[:300])
                    assert "Log in to Airflow" in response.text and 'href="/auth/login' in response.text, where
                assert_absent(response.text, forbidden, where)


def test_a_user_who_may_read_no_dag_sees_nothing(
    view_deployment: Deployment, view_seeded: Seeded, view_target: str
) -> None:
    headers = bearer(view_deployment, "outsider")
    forbidden = [*ledger_markers(view_seeded), *all_connection_details(view_target), policies_file(view_deployment)]
    overview = get(view_deployment, "/", {}, headers)
    assert overview.status_code == 200
    assert shown_policies(overview.text) == set() and shown_problems(overview.text) == set()
    assert "none you may read" in overview.text
    assert_absent(overview.text, [*forbidden, "events_purge", "unreachable", "bad_retention"], "outsider's overview")
    for params in route_requests(view_seeded)["/run"][:2]:
        run = get(view_deployment, "/run", params, headers)
        assert run.status_code == 404 and "Not found" in run.text, params
        assert_absent(run.text, [*forbidden, CHUNK_ERROR], f"outsider's run page {params}")


def test_a_limited_viewer_sees_only_their_dags_and_no_connection_detail(
    view_deployment: Deployment, view_seeded: Seeded, view_target: str
) -> None:
    headers = bearer(view_deployment, "limited")
    details = all_connection_details(view_target)

    overview = get(view_deployment, "/", {}, headers)
    assert overview.status_code == 200
    assert shown_policies(overview.text) == {"unreachable", "missing_table", "stalled"}
    assert shown_problems(overview.text) == {"retention_bad_retention"} == ALL_PROBLEMS & set(LIMITED_DAGS)
    assert "field 'name'" not in overview.text  # the problem of the DAG they may not read
    assert policies_file(view_deployment) in overview.text  # they see policies of that file
    # The failed connection is named, without what only its readers may see.
    alert = re.search(r'<section [^>]*data-policy="unreachable".*?</section>', overview.text, re.S)
    assert alert is not None and "retention_broken" in alert.group(0)
    assert_absent(overview.text, [*ledger_markers(view_seeded), "events_purge", *details], "limited's overview")

    # Another DAG's policy is not found, as an unknown one is; theirs says which connection failed.
    hidden = get(view_deployment, "/run", {"policy": "events_purge", "key": view_seeded.partial}, headers)
    assert hidden.status_code == 404 and "No policy 'events_purge'" in unescape(hidden.text)
    assert "data-chunk-key" not in hidden.text
    assert_absent(hidden.text, [*ledger_markers(view_seeded), *details], "limited's run page of events_purge")
    theirs = get(view_deployment, "/run", {"policy": "unreachable", "key": view_seeded.partial}, headers)
    assert theirs.status_code == 503 and "Ledger unavailable" in theirs.text and "retention_broken" in theirs.text
    assert_absent(theirs.text, details, "limited's run page of unreachable")


def test_admin_sees_everything_with_the_connections_details(view_deployment: Deployment, view_seeded: Seeded) -> None:
    headers = bearer(view_deployment, "admin")
    overview = get(view_deployment, "/", {}, headers)
    assert overview.status_code == 200
    assert shown_policies(overview.text) == ALL_POLICIES
    assert shown_problems(overview.text) == ALL_PROBLEMS
    assert policies_file(view_deployment) in overview.text
    assert view_seeded.partial in overview.text
    # The failed connection's details: the driver's words (host, port) and the DSN it was given (user, database).
    for page in (
        overview,
        get(view_deployment, "/run", {"policy": "unreachable", "key": view_seeded.partial}, headers),
    ):
        assert all(d in page.text for d in ("127.0.0.1", "port 1", BROKEN_USER, BROKEN_DB)), page.text[:2000]

    run = get(view_deployment, "/run", {"policy": "events_purge", "key": view_seeded.partial}, headers)
    assert run.status_code == 200 and view_seeded.failing_chunk in run.text


def test_a_route_added_to_the_app_needs_a_login_without_asking_for_it() -> None:
    """The login is the app's dependency: a new route that forgets it is refused all the same."""
    from fastapi.testclient import TestClient

    app = create_app()

    @app.get("/probe")
    def probe() -> str:
        return "ledger data"

    client = TestClient(app)
    response = client.get("/probe")
    assert response.status_code == 401 and "ledger data" not in response.text
    assert client.get("/icon.svg").status_code == 200


def test_the_readable_dags_are_the_auth_managers_own_filter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The DAGs come from ``get_authorized_dag_ids`` (which knows each DAG's team), not from
    ``is_authorized_dag`` asked without a team, which a multi-team auth manager may grant."""
    from airflow_retention.plugins import app as view_app
    from airflow_retention.plugins.data import PolicyProblem, PolicySet

    class TeamScoped:
        def __init__(self) -> None:
            self.connections: list[Any] = []

        def get_authorized_dag_ids(self, *, user: Any, method: str = "GET") -> set[str]:
            assert method == "GET"
            return {"retention_ours", "retention_our_typo"}

        def is_authorized_dag(self, **_: Any) -> bool:
            return True  # without the DAG's team, every DAG looks like one of no team

        def is_authorized_connection(self, *, method: str, details: Any, user: Any) -> bool:
            self.connections.append(details)
            return details.conn_id == "ours_conn"

    manager = TeamScoped()
    monkeypatch.setattr(view_app, "_auth_manager", lambda: manager)
    ours, theirs = (RetentionPolicy.from_dict(view_policy_data("s", c, FIRST, name=n)) for n, c in NAMES)
    problems = [PolicyProblem("retention_our_typo", "typo"), PolicyProblem("retention_invalid_policies", "theirs")]
    access = view_app.Access.of("a user")
    seen = access.policies(PolicySet(tmp_path, [ours, theirs], problems))
    assert (seen.policies, seen.problems, seen.source) == ([ours], problems[:1], tmp_path)
    assert access.policies(PolicySet(tmp_path, [theirs], problems[1:])).source is None  # nothing: no path
    assert access.may_read_connection("ours_conn") and not access.may_read_connection("theirs_conn")
    assert access.may_read_connection("ours_conn")  # asked once per connection and request
    assert [d.conn_id for d in manager.connections] == ["ours_conn", "theirs_conn"]
