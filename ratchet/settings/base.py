"""What every settings section shares: the strict base model, names, and the error type."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
)

# \Z, not $: "$" would also accept a name followed by a newline.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
# A DNS name (or an IPv4 address); IPv6 addresses are checked with ipaddress.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
HOST_PATTERN = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?\Z")
NAME_RULE = (
    "lower-case letters, digits, '.', '_' or '-', starting with a letter or digit, "
    "at most 64 characters"
)
DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
DEFAULT_RUBRIC = (
    "A good answer follows the user's instructions, is correct, complete and concise. "
    "A worse answer is wrong, ignores part of the request, or pads with irrelevant text."
)


def default_home() -> Path:
    """Where the embedded stack keeps its state, logs, model cache and adapter store."""
    return Path(os.environ.get("RATCHET_HOME", Path.home() / ".cache" / "ratchet"))


class ConfigError(Exception):
    """Settings that cannot start a service; the message names each setting and its fix."""


class _Section(BaseModel):
    # A typo in ratchet.yaml should fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid")


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
