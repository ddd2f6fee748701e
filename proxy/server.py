"""Running the proxy under uvicorn (``ratchet proxy``)."""

from __future__ import annotations

import gc
import logging

import uvicorn

from proxy.app import create_app
from ratchet.settings import RatchetSettings


def serve(settings: RatchetSettings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = create_app(settings)
    # Everything imported and built so far lives as long as the process: out of the collector's
    # sight, a full collection no longer walks it, which is a pause in the middle of requests.
    gc.freeze()
    uvicorn.run(
        app,
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
