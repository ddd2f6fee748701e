"""`ratchet console`: serve the console with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from console.app import create_app
from ratchet.settings import RatchetSettings


def serve(settings: RatchetSettings) -> None:
    settings.check_console_exposure()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.console.host,
        port=settings.console.port,
        log_level="warning",
        access_log=False,
    )
