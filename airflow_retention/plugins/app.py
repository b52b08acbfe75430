"""The view's FastAPI app, mounted by the api-server at ``/retention``: for logged-in users only.

A request is the user's when it carries the Airflow UI's session (the ``_token`` cookie the login sets) or
an ``Authorization: Bearer`` token, validated by the auth manager as the REST API validates it; a user an
Airflow middleware already authenticated (a refreshed session) is taken as is. Anything else gets 401 and
a link to the login page, and no ledger is read. The login is one dependency of the whole app, so a route
added later is covered too; only the paths in :data:`PUBLIC_PATHS` (the navigation icon) are left open.

What a logged-in user sees follows Airflow's own permissions, asked of the auth manager:

- a policy, and a problem of the policies file, only if the user may read its DAG (``retention_<name>``):
  the auth manager's own filter of readable DAG ids, which also scopes teams (``[core] multi_team``);
- a connection's details (the driver's words: host, port, user, database) only if the user may read that
  connection; everyone else sees only its ``conn_id``;
- the policies file's path on the server only if the user sees something that came from it.

Pages are rendered on the server (no script runs in them) and never cached.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response

if TYPE_CHECKING:
    from airflow_retention.plugins.data import PolicyPanel, PolicySet

MOUNT = "/retention"
COOKIE = "_token"  # airflow.api_fastapi.auth.managers.base_auth_manager.COOKIE_NAME_JWT_TOKEN
HEADERS = {
    "Cache-Control": "no-store",
    # Framed only by the Airflow UI itself (the navigation entry opens it in a frame); nothing loads from outside.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:;"
    " frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
}
ICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="#4f7cac" stroke-width="2"'
    ' stroke-linecap="round" stroke-linejoin="round"><path d="M3 6h18M8 6V4h8v2M6 6l1 14h10l1-14"/>'
    '<path d="M10 10v6M14 10v6"/></svg>'
)


class LoginRequired(Exception):
    """The request carries no valid Airflow session or token."""


def html(content: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(content, status_code=status_code, headers=HEADERS)


def _auth_manager() -> Any:
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


def _token(request: Request) -> str | None:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.cookies.get(COOKIE) or None


def _trusted_middleware_user(request: Request) -> Any:
    """The user Airflow's own JWT refresh middleware authenticated for this request (Airflow 3.1+), if any."""
    try:
        from airflow.api_fastapi.core_api.security import USER_INJECTED_BY_TRUSTED_MIDDLEWARE
    except ImportError:  # Airflow 3.0: no such middleware
        return None
    user = getattr(request.state, "user", None)
    trusted = getattr(request.state, "user_authenticated_via", None) is USER_INJECTED_BY_TRUSTED_MIDDLEWARE
    return user if trusted else None


async def authenticate(request: Request) -> Any:
    """The logged-in user, or :class:`LoginRequired`."""
    from jwt import InvalidTokenError  # ExpiredSignatureError is one

    user = _trusted_middleware_user(request)
    if user is not None:
        return user
    token = _token(request)
    if token is None:
        raise LoginRequired("not logged in")
    try:
        return await _auth_manager().get_user_from_token(token)
    except InvalidTokenError as exc:
        raise LoginRequired(f"session not valid: {exc}") from None


# The app's only routes open to anyone: they serve no ledger data and nothing of the deployment.
PUBLIC_PATHS = frozenset({"/icon.svg"})
_USER = "retention_user"  # request.state attribute; Airflow's own middleware uses ``user``


async def require_login(request: Request) -> None:
    """The app-wide dependency: authenticates every request but those of :data:`PUBLIC_PATHS`."""
    route = request.scope.get("route")
    if getattr(route, "path", None) in PUBLIC_PATHS:
        return
    setattr(request.state, _USER, await authenticate(request))


def current_user(request: Request) -> Any:
    """The user :func:`require_login` authenticated; a route that runs without it refuses (fails closed)."""
    user = getattr(request.state, _USER, None)
    if user is None:
        raise LoginRequired("not logged in")
    return user


User = Annotated[Any, Depends(current_user)]


def _connection_details(conn_id: str) -> Any:
    """``ConnectionDetails`` as Airflow's connection endpoints build them: with the connection's team when
    ``[core] multi_team`` is on (Airflow 3.2+; a connection outside the metadata database has none)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    from airflow_retention.compat import conf

    if conf.getboolean("core", "multi_team", fallback=False):
        from airflow.models.connection import Connection

        team_of = getattr(Connection, "get_team_name", None)
        if team_of is not None:
            return ConnectionDetails(conn_id=conn_id, team_name=team_of(conn_id))
    return ConnectionDetails(conn_id=conn_id)


@dataclass
class Access:
    """What one user may read, asked of the auth manager once per request."""

    user: Any
    dag_ids: frozenset[str]
    _connections: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, user: Any) -> Access:
        # The auth manager's own filter (not is_authorized_dag per policy): it looks up each DAG's team, and
        # an auth manager may answer it at once. A policy whose DAG Airflow has not parsed yet is no one's.
        return cls(user, frozenset(_auth_manager().get_authorized_dag_ids(user=user, method="GET")))

    def may_read_dag(self, dag_id: str) -> bool:
        return dag_id in self.dag_ids

    def may_read_connection(self, conn_id: str) -> bool:
        if conn_id not in self._connections:
            allowed = _auth_manager().is_authorized_connection(
                method="GET", details=_connection_details(conn_id), user=self.user
            )
            self._connections[conn_id] = bool(allowed)
        return self._connections[conn_id]

    def policies(self, policy_set: PolicySet) -> PolicySet:
        """The part of the policies file this user may see (the file's path only with something in it)."""
        from airflow_retention.plugins.data import dag_id

        policies = [p for p in policy_set.policies if self.may_read_dag(dag_id(p))]
        problems = [p for p in policy_set.problems if self.may_read_dag(p.dag_id)]
        source = policy_set.source if policies or problems else None
        return dataclasses.replace(policy_set, source=source, policies=policies, problems=problems)

    def panel(self, panel: PolicyPanel) -> PolicyPanel:
        """The panel with its connection's details only for a user who may read that connection."""
        return panel if self.may_read_connection(panel.policy.conn_id) else panel.without_connection_details()


def ui_root(request: Request) -> str:
    """The Airflow UI's root path as seen from this request (``/``, or the base URL's path)."""
    root = request.scope.get("root_path", "")
    return (root[: -len(MOUNT)] if root.endswith(MOUNT) else "") + "/"


def create_app() -> FastAPI:
    # The login is the app's dependency, not each route's: a route added later cannot be left out of it.
    app = FastAPI(
        title="Retention", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(require_login)]
    )

    @app.exception_handler(LoginRequired)
    async def login_required(request: Request, exc: LoginRequired) -> HTMLResponse:
        from airflow_retention.plugins.render import message_page

        try:
            login = _auth_manager().get_url_login()
        except Exception:  # noqa: BLE001 - the link is a courtesy; the refusal is what matters
            login = ui_root(request)
        text = "The Retention view is for logged-in Airflow users only: log in, then open it again."
        return html(message_page("Log in to Airflow", text, link=(login, "Log in"), top=True), 401)

    @app.get("/icon.svg", include_in_schema=False)
    def icon() -> Response:
        # The navigation entry's icon: a static picture, no ledger data, so no login needed (PUBLIC_PATHS).
        return Response(ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request, user: User) -> HTMLResponse:
        from airflow_retention.plugins.data import load_panels, read_policies
        from airflow_retention.plugins.render import overview_page

        access = Access.of(user)
        policy_set = access.policies(read_policies())
        panels = [access.panel(p) for p in load_panels(policy_set.policies)]
        now = next((p.status.as_of for p in panels if p.status is not None), None)
        if now is None:
            from datetime import datetime, timezone

            now = datetime.now(timezone.utc)
        return html(overview_page(policy_set, panels, now))

    @app.get("/run", response_class=HTMLResponse)
    def run(
        request: Request,
        policy: Annotated[str, Query(description="the policy's name")],
        key: Annotated[str, Query(description="the run key")],
        user: User,
    ) -> HTMLResponse:
        from airflow_retention.plugins.data import failure_text, load_run, read_policies
        from airflow_retention.plugins.render import message_page, run_page

        back = ("./", "all policies")
        access = Access.of(user)
        found = [p for p in access.policies(read_policies()).policies if p.name == policy]
        if not found:
            return html(message_page("Not found", f"No policy {policy!r} (or not yours to read).", link=back), 404)
        conn_id = found[0].conn_id
        try:
            detail = load_run(found[0], key)
        except Exception as exc:  # noqa: BLE001 - an unreachable database is a message, not a stack trace
            text = f"The ledger of {policy} cannot be read through connection {conn_id!r}"
            if access.may_read_connection(conn_id):
                text += f": {failure_text(exc)}"
            else:  # the driver's words name the connection's host, port, user and database
                text += " (the error is shown to users who may read that connection)."
            return html(message_page("Ledger unavailable", text, link=back, alert=True), 503)
        if detail is None:
            return html(message_page("Not found", f"The ledger has no run {key!r} of {policy}.", link=back), 404)
        return html(run_page(detail))

    return app
