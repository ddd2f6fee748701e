"""Running the proxy under uvicorn (``ratchet proxy``)."""

from __future__ import annotations

import logging

import uvicorn

from proxy.app import create_app
from ratchet.settings import RatchetSettings


def serve(settings: RatchetSettings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.proxy.host,
        port=settings.proxy.port,
        # uvloop + httptools: the fastest event loop and HTTP parser uvicorn offers.
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="info",
        # Long enough for in-flight streams to finish and the log queue to drain.
        timeout_graceful_shutdown=30,
    )
