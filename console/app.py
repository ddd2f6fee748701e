"""The console's HTTP routes: pages, their live fragments, login, actions, health and metrics.

Pages are rendered on the server (console/render.py) from what console/views.py reads; each page
has a ``/live`` fragment that console.js polls. Actions post a form (with its confirmation box)
and redirect back to the alias page, which shows the outcome.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from console.actions import ACTIONS, ActionRefused, ActionRequest, Actions, BackgroundEvents
from console.auth import COOKIE, ConsoleAuth
from console.metrics import ConsoleMetrics
from console.render import render, rounds_svg
from console.stats import ThroughputReader, reachable
from console.traffic import RecentTraffic, TrafficReader
from console.views import ConsoleData
from ratchet.secrets import vllm_api_key
from ratchet.settings import RatchetSettings

STATIC = Path(__file__).parent / "static"
HEALTH_TTL_S = 5.0
MESSAGE_CHARS = 300
COMPLETION_ID_CHARS = 128


class Health:
    """Whether Redis, the proxy, vLLM and Kafka are up, checked at most every HEALTH_TTL_S."""

    def __init__(
        self, settings: RatchetSettings, data: ConsoleData, throughput: ThroughputReader
    ) -> None:
        self.settings = settings
        self.data = data
        self.throughput = throughput  # its scrape of the proxy's metrics says whether Kafka is up
        self.checked = 0.0
        self.parts: dict[str, bool | None] = {}

    def read(self) -> dict[str, bool | None]:
        if time.monotonic() - self.checked > HEALTH_TTL_S:
            self.parts = self.check()
            self.checked = time.monotonic()
        return self.parts

    def check(self) -> dict[str, bool | None]:
        proxy = proxy_url(self.settings)
        self.throughput.read()  # a fresh enough scrape of the proxy's metrics
        headers = {"authorization": f"Bearer {vllm_api_key(self.settings)}"}
        return {
            "Redis": self.data.redis_up(),
            "proxy": _ok(f"{proxy}/healthz"),
            "vLLM": _ok(f"{self.settings.vllm_url.rstrip('/')}/health", headers),
            "Kafka": self.throughput.kafka_up(),
        }


def proxy_url(settings: RatchetSettings) -> str:
    if settings.console.proxy_url:
        return settings.console.proxy_url.rstrip("/")
    return f"http://{reachable(settings.proxy.host)}:{settings.proxy.port}"


def _ok(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        return httpx.get(url, timeout=1.0, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def create_app(settings: RatchetSettings, start_readers: bool = True) -> FastAPI:
    """``start_readers``: read recent traffic from Kafka (tests feed ``app.state.recent``)."""
    data = ConsoleData(settings)
    auth = ConsoleAuth(settings)
    metrics = ConsoleMetrics()
    events = BackgroundEvents(settings, metrics.events_dropped.inc)
    actions = Actions(settings, data.writer, events)
    throughput = ThroughputReader(settings, proxy_url(settings))
    health = Health(settings, data, throughput)
    recent = RecentTraffic(set(settings.aliases))
    if start_readers:
        TrafficReader(settings, recent).start()
    app = FastAPI(title="Ratchet console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.recent = recent
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    refresh_ms = int(settings.console.refresh_s * 1000)

    def page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        with metrics.render_seconds.labels(template).time():
            html = render(
                template,
                is_admin=auth.is_admin(request),
                actions_enabled=auth.actions_enabled,
                request_path=request.url.path,
                refresh_ms=refresh_ms,
                **context,
            )
        return HTMLResponse(html, status_code=status)

    def readable(request: Request) -> None:
        if not auth.may_read(request):
            raise HTTPException(401, "log in with the admin key to read this console")

    def overview_context() -> dict[str, Any]:
        return {
            "aliases": data.summaries(),
            "health": health.read(),
            "throughput": throughput.read(),
            "ratings": {alias: recent.ratings(alias) for alias in settings.aliases},
        }

    def alias_context(alias: str) -> dict[str, Any]:
        detail = data.detail(alias)
        if detail is None:
            raise HTTPException(404, f"no alias {alias!r} in this console's config")
        threshold = settings.aliases[alias].gate.threshold
        return {
            "alias": alias,
            "detail": detail,
            "plot": rounds_svg(detail.rounds, threshold),
            "ratings": recent.ratings(alias),
        }

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "other")
        metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 401 and request.method == "GET" and "/live" not in request.url.path:
            return RedirectResponse(f"/login?next={quote(request.url.path)}", status_code=303)
        wants_html = "text/html" in request.headers.get("accept", "")
        if wants_html:
            return HTMLResponse(
                render("error.html", status=exc.status_code, detail=exc.detail),
                status_code=exc.status_code,
            )
        return JSONResponse({"error": {"message": exc.detail}}, status_code=exc.status_code)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> HTMLResponse:
        readable(request)
        return page(request, "overview.html", **overview_context())

    @app.get("/live", response_class=HTMLResponse)
    def overview_live(request: Request) -> HTMLResponse:
        readable(request)
        return page(request, "_overview_live.html", **overview_context())

    @app.get("/alias/{alias}", response_class=HTMLResponse)
    def alias_page(
        request: Request, alias: str, done: str | None = None, refused: str | None = None
    ) -> HTMLResponse:
        readable(request)
        message, kind = None, None
        if done in ACTIONS:
            message, kind = f"{done}: done", "ok"
        elif refused:
            message, kind = f"Refused: {refused[:MESSAGE_CHARS]}", "bad"
        return page(
            request, "alias.html", message=message, message_kind=kind, **alias_context(alias)
        )

    @app.get("/alias/{alias}/traffic", response_class=HTMLResponse)
    def alias_traffic(request: Request, alias: str, completion_id: str = "") -> HTMLResponse:
        readable(request)
        if alias not in settings.aliases:
            raise HTTPException(404, f"no alias {alias!r} in this console's config")
        wanted = completion_id.strip()[:COMPLETION_ID_CHARS]
        return page(
            request,
            "traffic.html",
            alias=alias,
            completion_id=wanted,
            exchanges=recent.recent(alias, wanted or None),
        )

    @app.get("/alias/{alias}/live", response_class=HTMLResponse)
    def alias_live(request: Request, alias: str) -> HTMLResponse:
        readable(request)
        return page(request, "_alias_live.html", **alias_context(alias))

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "/") -> HTMLResponse:
        return page(request, "login.html", next=safe_next(next))

    @app.post("/login")
    def login(request: Request, key: str = Form(...), next: str = Form("/")) -> Response:
        same_origin(request)
        if not auth.key_matches(key) or auth.session_token is None:
            metrics.logins.labels("refused").inc()
            return page(
                request,
                "login.html",
                status=401,
                next=safe_next(next),
                message="That is not the admin key.",
                message_kind="bad",
            )
        metrics.logins.labels("ok").inc()
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
        if not auth.is_admin(request):
            metrics.actions.labels(action, "unauthorized").inc()
            raise HTTPException(403, "actions need the admin key: log in first")
        back = f"/alias/{quote(alias)}"
        if confirm != "yes":
            metrics.actions.labels(action, "unconfirmed").inc()
            why = quote("tick the confirmation box to apply the change")
            return RedirectResponse(f"{back}?refused={why}", status_code=303)
        try:
            request_ = ActionRequest(
                action=action,
                alias=alias,
                version=int(version) if version.strip() else None,
                reason=reason,
                weight=float(weight) if weight.strip() else None,
            )
            actions.apply(request_)
        except (ActionRefused, ValueError) as exc:
            metrics.actions.labels(action, "refused").inc()
            return RedirectResponse(f"{back}?refused={quote(str(exc)[:MESSAGE_CHARS])}", 303)
        metrics.actions.labels(action, "applied").inc()
        return RedirectResponse(f"{back}?done={action}", status_code=303)

    return app


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
