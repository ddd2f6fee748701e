"""`ratchet console`: serve the console with uvicorn, within limits (console/guard.py): a deadline
on each request's head, a cap on its size, a short keep-alive, and a bound on connections and
requests in flight, beyond which uvicorn answers 503."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

from console.app import create_app
from console.guard import MAX_HEAD_BYTES, ConsoleProtocol
from ratchet.settings import RatchetSettings

MAX_CONCURRENCY = 64  # a few operators' browsers, each polling one page
KEEPALIVE_S = 5

log = logging.getLogger(__name__)


def server_config(app: FastAPI, settings: RatchetSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.console.host,
        port=settings.console.port,
        http=ConsoleProtocol,
        ws="none",
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_keep_alive=KEEPALIVE_S,
        limit_concurrency=MAX_CONCURRENCY,
        server_header=False,
        log_level="warning",
        access_log=False,  # every open page polls each second; logins and actions are logged
    )


def serve(settings: RatchetSettings) -> None:
    settings.check_console_exposure()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.console_needs_login and not settings.console.allowed_hosts:
        log.warning(
            "console.allowed_hosts is empty while console.host is %r: any Host name is served. "
            "Set it to the names browsers use for the console (e.g. console.example.com)",
            settings.console.host,
        )
    uvicorn.Server(server_config(create_app(settings), settings)).run()
