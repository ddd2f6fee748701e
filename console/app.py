"""The console's HTTP routes: pages, their live fragments, login, actions, health and metrics.

Pages are rendered on the server (console/render.py) from what console/views.py reads; each page
has a ``/live`` fragment that console.js polls. Actions post a form (with its confirmation box)
and redirect back to the alias page, which shows the outcome.

:func:`create_app` wires one :class:`Console` (what every route reads) into the routes, one
concern per ``_add_*`` function, as proxy/app.py does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from console.actions import ACTIONS, ActionRefused, ActionRequest, Actions, BackgroundEvents
from console.auth import COOKIE, ConsoleAuth
from console.health import Health, proxy_url
from console.metrics import ConsoleMetrics
from console.render import render, rounds_svg
from console.stats import ThroughputReader
from console.traffic import RecentTraffic, TrafficReader
from console.views import ConsoleData
from ratchet.settings import RatchetSettings

STATIC = Path(__file__).parent / "static"
MESSAGE_CHARS = 300
COMPLETION_ID_CHARS = 128


class Console:
    """What the routes read and act through: the settings, Redis and the services' metrics,
    recent traffic from Kafka, who is admin, the actions, and the console's own metrics."""

    def __init__(self, settings: RatchetSettings, start_readers: bool) -> None:
        self.settings = settings
        self.data = ConsoleData(settings)
        self.auth = ConsoleAuth(settings)
        self.metrics = ConsoleMetrics()
        events = BackgroundEvents(settings, self.metrics.events_dropped.inc)
        self.actions = Actions(settings, self.data.writer, events)
        self.throughput = ThroughputReader(settings, proxy_url(settings))
        self.health = Health(settings, self.data, self.throughput)
        self.recent = RecentTraffic(set(settings.aliases))
        if start_readers:
            TrafficReader(settings, self.recent).start()
        self.refresh_ms = int(settings.console.refresh_s * 1000)

    def page(
        self, request: Request, template: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        with self.metrics.render_seconds.labels(template).time():
            html = render(
                template,
                is_admin=self.auth.is_admin(request),
                actions_enabled=self.auth.actions_enabled,
                request_path=request.url.path,
                refresh_ms=self.refresh_ms,
                **context,
            )
        return HTMLResponse(html, status_code=status)

    def require_reader(self, request: Request) -> None:
        if not self.auth.may_read(request):
            raise HTTPException(401, "log in with the admin key to read this console")

    def require_alias(self, alias: str) -> None:
        if alias not in self.settings.aliases:
            raise HTTPException(404, f"no alias {alias!r} in this console's config")

    async def overview_context(self) -> dict[str, Any]:
        health = await self.health.read()
        # Redis and the metrics scrape block: off the event loop, side by side.
        aliases, throughput = await asyncio.gather(
            asyncio.to_thread(self.data.summaries), asyncio.to_thread(self.throughput.read)
        )
        return {
            "aliases": aliases,
            "health": health,
            "throughput": throughput,
            "ratings": {alias: self.recent.ratings(alias) for alias in self.settings.aliases},
        }

    def alias_context(self, alias: str) -> dict[str, Any]:
        detail = self.data.detail(alias)
        if detail is None:
            raise HTTPException(404, f"no alias {alias!r} in this console's config")
        threshold = self.settings.aliases[alias].gate.threshold
        return {
            "alias": alias,
            "detail": detail,
            "plot": rounds_svg(detail.rounds, threshold),
            "ratings": self.recent.ratings(alias),
        }


def create_app(settings: RatchetSettings, start_readers: bool = True) -> FastAPI:
    """``start_readers``: read recent traffic from Kafka (tests feed ``app.state.recent``)."""
    console = Console(settings, start_readers)
    app = FastAPI(title="Ratchet console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.recent = console.recent
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_request_counter(app, console.metrics)
    _install_error_handler(app)
    _add_probe_routes(app, console.metrics)
    _add_overview_routes(app, console)
    _add_alias_routes(app, console)
    _add_session_routes(app, console)
    _add_action_route(app, console)
    return app


def _add_request_counter(app: FastAPI, metrics: ConsoleMetrics) -> None:
    @app.middleware("http")
    async def count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "other")
        metrics.requests.labels(path, str(response.status_code)).inc()
        return response


def _install_error_handler(app: FastAPI) -> None:
    """A page that needs a login redirects to it; otherwise an error page for a browser and a
    JSON envelope for anything else."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 401 and request.method == "GET" and "/live" not in request.url.path:
            return RedirectResponse(f"/login?next={quote(request.url.path)}", status_code=303)
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(
                render("error.html", status=exc.status_code, detail=exc.detail),
                status_code=exc.status_code,
            )
        return JSONResponse({"error": {"message": exc.detail}}, status_code=exc.status_code)


def _add_probe_routes(app: FastAPI, metrics: ConsoleMetrics) -> None:
    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_overview_routes(app: FastAPI, console: Console) -> None:
    @app.get("/", response_class=HTMLResponse)
    async def overview(request: Request) -> HTMLResponse:
        console.require_reader(request)
        return console.page(request, "overview.html", **await console.overview_context())

    @app.get("/live", response_class=HTMLResponse)
    async def overview_live(request: Request) -> HTMLResponse:
        console.require_reader(request)
        return console.page(request, "_overview_live.html", **await console.overview_context())


def _add_alias_routes(app: FastAPI, console: Console) -> None:
    @app.get("/alias/{alias}", response_class=HTMLResponse)
    def alias_page(
        request: Request, alias: str, done: str | None = None, refused: str | None = None
    ) -> HTMLResponse:
        console.require_reader(request)
        message, kind = None, None
        if done in ACTIONS:
            message, kind = f"{done}: done", "ok"
        elif refused:
            message, kind = f"Refused: {refused[:MESSAGE_CHARS]}", "bad"
        context = console.alias_context(alias)
        return console.page(request, "alias.html", message=message, message_kind=kind, **context)

    @app.get("/alias/{alias}/traffic", response_class=HTMLResponse)
    def alias_traffic(request: Request, alias: str, completion_id: str = "") -> HTMLResponse:
        console.require_reader(request)
        console.require_alias(alias)
        wanted = completion_id.strip()[:COMPLETION_ID_CHARS]
        return console.page(
            request,
            "traffic.html",
            alias=alias,
            completion_id=wanted,
            exchanges=console.recent.recent(alias, wanted or None),
        )

    @app.get("/alias/{alias}/live", response_class=HTMLResponse)
    def alias_live(request: Request, alias: str) -> HTMLResponse:
        console.require_reader(request)
        return console.page(request, "_alias_live.html", **console.alias_context(alias))


def _add_session_routes(app: FastAPI, console: Console) -> None:
    """Login with the admin key sets the session cookie (console/auth.py); logout drops it."""

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "/") -> HTMLResponse:
        return console.page(request, "login.html", next=safe_next(next))

    @app.post("/login")
    def login(request: Request, key: str = Form(...), next: str = Form("/")) -> Response:
        same_origin(request)
        auth = console.auth
        if not auth.key_matches(key) or auth.session_token is None:
            console.metrics.logins.labels("refused").inc()
            return console.page(
                request,
                "login.html",
                status=401,
                next=safe_next(next),
                message="That is not the admin key.",
                message_kind="bad",
            )
        console.metrics.logins.labels("ok").inc()
        response = RedirectResponse(safe_next(next), status_code=303)
        response.set_cookie(
            COOKIE,
            auth.session_token,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.post("/logout")
    def logout(request: Request) -> Response:
        same_origin(request)
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE)
        return response


def _add_action_route(app: FastAPI, console: Console) -> None:
    """Promote, rollback, pause, resume or weigh the canary: the admin key and the confirmation
    box first, then the CLI's lifecycle change with the console as its actor."""

    @app.post("/alias/{alias}/{action}")
    def act(
        request: Request,
        alias: str,
        action: str,
        confirm: str = Form(""),
        version: str = Form(""),
        reason: str = Form(""),
        weight: str = Form(""),
    ) -> Response:
        same_origin(request)
        if action not in ACTIONS:
            raise HTTPException(404, f"no action {action!r}")
        outcomes = console.metrics.actions
        if not console.auth.is_admin(request):
            outcomes.labels(action, "unauthorized").inc()
            raise HTTPException(403, "actions need the admin key: log in first")
        back = f"/alias/{quote(alias)}"
        if confirm != "yes":
            outcomes.labels(action, "unconfirmed").inc()
            why = quote("tick the confirmation box to apply the change")
            return RedirectResponse(f"{back}?refused={why}", status_code=303)
        try:
            console.actions.apply(
                ActionRequest(
                    action=action,
                    alias=alias,
                    version=int(version) if version.strip() else None,
                    reason=reason,
                    weight=float(weight) if weight.strip() else None,
                )
            )
        except (ActionRefused, ValueError) as exc:
            outcomes.labels(action, "refused").inc()
            return RedirectResponse(f"{back}?refused={quote(str(exc)[:MESSAGE_CHARS])}", 303)
        outcomes.labels(action, "applied").inc()
        return RedirectResponse(f"{back}?done={action}", status_code=303)


def safe_next(target: str) -> str:
    """Only a path on this console: never another site after login."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return "/"
    return target


def same_origin(request: Request) -> None:
    """A form posted from another site is refused (the session cookie is SameSite=Strict too)."""
    origin = request.headers.get("origin")
    if origin and urlsplit(origin).netloc != request.headers.get("host", ""):
        raise HTTPException(403, "cross-site form posts are refused")
