"""The console's HTTP routes: pages, their live fragments, login, actions, health and metrics.

Pages are rendered on the server (console/render.py) from what console/views.py reads; each page
has a ``/live`` fragment that console.js polls. Actions post a form (with its confirmation box)
and redirect back to the alias page, which shows the outcome.

:func:`create_app` wires one :class:`Console` (what every route reads) into the routes, one
concern per ``_add_*`` function, as proxy/app.py does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from console.actions import ACTIONS, ActionRefused, ActionRequest, Actions, BackgroundEvents
from console.auth import COOKIE, Admin, ConsoleAuth, source_of
from console.guard import MAX_BODY_BYTES, Guard
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
FORM_FIELDS = 8  # the action form has 5; more is not a form of this console

log = logging.getLogger(__name__)


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

    async def identify(self, request: Request) -> Admin | None:
        """The request's admin, asked of Redis off the event loop; later checks reuse it."""
        return await asyncio.to_thread(self.auth.admin, request)

    def require_reader(self, request: Request) -> None:
        if not self.auth.may_read(request):
            raise HTTPException(401, "log in with the admin key to read this console")

    def require_alias(self, alias: str) -> None:
        if alias not in self.settings.aliases:
            raise HTTPException(404, f"no alias {alias!r} in this console's config")

    async def overview_context(self) -> dict[str, Any]:
        health = await self.health.read()
        # Redis blocks: off the event loop, beside the metrics scrape.
        aliases, throughput = await asyncio.gather(
            asyncio.to_thread(self.data.summaries), self.throughput.read()
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
    app.add_middleware(Guard, allowed_hosts=allowed_hosts(settings))
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
        error = {"message": exc.detail, "type": "invalid_request_error", "param": None}
        return JSONResponse({"error": {**error, "code": None}}, status_code=exc.status_code)


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
        await console.identify(request)
        console.require_reader(request)
        return console.page(request, "overview.html", **await console.overview_context())

    @app.get("/live", response_class=HTMLResponse)
    async def overview_live(request: Request) -> HTMLResponse:
        await console.identify(request)
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
    """Login with the admin key starts a session (console/sessions.py) and sets its cookie;
    logout ends it in Redis, not only in this browser."""

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "/") -> HTMLResponse:
        return console.page(request, "login.html", next=safe_next(next))

    @app.post("/login")
    async def login(request: Request) -> Response:
        same_origin(request)
        await console.identify(request)  # the page drawn next asks who is admin
        form = await form_of(request)
        key, target = form.get("key", ""), safe_next(form.get("next", "/"))
        outcome = await asyncio.to_thread(console.auth.login, request, key)
        if isinstance(outcome, str):
            console.metrics.logins.labels(outcome).inc()
            status, why = LOGIN_REFUSALS[outcome]
            return console.page(
                request, "login.html", status=status, next=target, message=why, message_kind="bad"
            )
        console.metrics.logins.labels("ok").inc()
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            outcome.token,
            max_age=console.settings.console.session_ttl_s,
            httponly=True,
            samesite="strict",
            # Off loopback TLS ends in front of the console, so its own scheme says nothing.
            secure=request.url.scheme == "https" or console.settings.console_needs_login,
        )
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        same_origin(request)
        await asyncio.to_thread(console.auth.logout, request)
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE)
        return response


LOGIN_REFUSALS = {
    "wrong": (401, "That is not the admin key."),
    "unavailable": (503, "Logins need Redis, which does not answer: try again shortly."),
}


def _add_action_route(app: FastAPI, console: Console) -> None:
    """Promote, rollback, pause, resume or weigh the canary: the admin key and the confirmation
    box first, then the CLI's lifecycle change, with the admin (session or key, and address) as
    its actor."""

    @app.post("/alias/{alias}/{action}")
    async def act(request: Request, alias: str, action: str) -> Response:
        same_origin(request)
        if action not in ACTIONS:
            raise HTTPException(404, f"no action {action!r}")
        outcomes = console.metrics.actions
        admin = await console.identify(request)
        if admin is None:
            outcomes.labels(action, "unauthorized").inc()
            log.warning(
                "console %s on %r refused: not an admin (%s)",
                action,
                alias[:64],
                source_of(request),
            )
            raise HTTPException(403, "actions need the admin key: log in first")
        form = await form_of(request)
        back = f"/alias/{quote(alias)}"
        if form.get("confirm") != "yes":
            outcomes.labels(action, "unconfirmed").inc()
            why = quote("tick the confirmation box to apply the change")
            return RedirectResponse(f"{back}?refused={why}", status_code=303)
        try:
            change = action_request(action, alias, form, admin)
            await asyncio.to_thread(console.actions.apply, change)
        except (ActionRefused, ValueError) as exc:
            outcomes.labels(action, "refused").inc()
            log.info("console %s on %s by %s refused: %s", action, alias, admin.actor, exc)
            return RedirectResponse(f"{back}?refused={quote(str(exc)[:MESSAGE_CHARS])}", 303)
        outcomes.labels(action, "applied").inc()
        log.info("console %s on %s by %s", action, alias, admin.actor)
        return RedirectResponse(f"{back}?done={action}", status_code=303)


def action_request(action: str, alias: str, form: dict[str, str], admin: Admin) -> ActionRequest:
    version, weight = form.get("version", "").strip(), form.get("weight", "").strip()
    return ActionRequest(
        action=action,  # type: ignore[arg-type]  # checked against ACTIONS
        alias=alias,
        version=int(version) if version else None,
        reason=form.get("reason", ""),
        weight=float(weight) if weight else None,
        actor=admin.actor,
    )


async def form_of(request: Request) -> dict[str, str]:
    """The posted form's text fields, parsed within small limits (the body is already capped
    by Guard): no files, a handful of fields."""
    form = await request.form(max_files=0, max_fields=FORM_FIELDS, max_part_size=MAX_BODY_BYTES)
    return {name: value for name, value in form.items() if isinstance(value, str)}


def allowed_hosts(settings: RatchetSettings) -> list[str]:
    """The Host names served besides loopback ones: the configured ones; off loopback with none
    configured, any (console/service.py warns)."""
    hosts = settings.console.allowed_hosts
    return hosts if hosts or not settings.console_needs_login else ["*"]


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
