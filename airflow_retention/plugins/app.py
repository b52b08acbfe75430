"""The view's FastAPI app, mounted by the api-server at ``/retention``: for logged-in users only.

A request is the user's when it carries the Airflow UI's session (the ``_token`` cookie the login sets) or
an ``Authorization: Bearer`` token, validated by the auth manager as the REST API validates it; a user an
Airflow middleware already authenticated (a refreshed session) is taken as is. Anything else gets 401 and
a link to the login page, and no ledger is read. A policy is shown only to a user who may read its DAG.

Pages are rendered on the server (no script runs in them) and never cached.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response

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


async def current_user(request: Request) -> Any:
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


User = Annotated[Any, Depends(current_user)]


def readable(user: Any, policies: list[Any]) -> list[Any]:
    """The policies whose DAG the user may read."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    from airflow_retention.plugins.data import dag_id

    manager = _auth_manager()
    return [p for p in policies if manager.is_authorized_dag(method="GET", details=DagDetails(id=dag_id(p)), user=user)]


def ui_root(request: Request) -> str:
    """The Airflow UI's root path as seen from this request (``/``, or the base URL's path)."""
    root = request.scope.get("root_path", "")
    return (root[: -len(MOUNT)] if root.endswith(MOUNT) else "") + "/"


def create_app() -> FastAPI:
    app = FastAPI(title="Retention", docs_url=None, redoc_url=None, openapi_url=None)

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
        # The navigation entry's icon: a static picture, no ledger data, so no login needed.
        return Response(ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request, user: User) -> HTMLResponse:
        from airflow_retention.plugins.data import load_panels, read_policies
        from airflow_retention.plugins.render import overview_page

        policy_set = read_policies()
        panels = load_panels(readable(user, policy_set.policies))
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
        found = [p for p in readable(user, read_policies().policies) if p.name == policy]
        if not found:
            return html(message_page("Not found", f"No policy {policy!r} (or not yours to read).", link=back), 404)
        try:
            detail = load_run(found[0], key)
        except Exception as exc:  # noqa: BLE001 - an unreachable database is a message, not a stack trace
            text = f"The ledger of {policy} cannot be read through connection {found[0].conn_id!r}: {failure_text(exc)}"
            return html(message_page("Ledger unavailable", text, link=back, alert=True), 503)
        if detail is None:
            return html(message_page("Not found", f"The ledger has no run {key!r} of {policy}.", link=back), 404)
        return html(run_page(detail))

    return app
