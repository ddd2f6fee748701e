"""The ``console`` section: the web console."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
)

from ratchet.settings.base import (
    HOST_PATTERN,
    _Section,
    is_ip_address,
)


class ConsoleSettings(_Section):
    """`ratchet console`: the web console (console/). Its admin actions take proxy.admin_key."""

    host: str = Field(
        default="127.0.0.1",
        description="Address the console listens on; other than loopback it needs proxy.admin_key.",
    )
    port: int = Field(
        default=8404,
        ge=1,
        le=65535,
        description="Port the console listens on.",
    )
    refresh_s: float = Field(
        default=1.0,
        gt=0.0,
        le=60.0,
        description="How often an open page asks for fresh data (seconds).",
    )
    proxy_url: str | None = Field(
        default=None,
        description=(
            "Where the health panel asks the proxy (its /healthz, and its /metrics for Kafka). "
            "None: proxy.host and proxy.port, which is right when both run on one machine."
        ),
    )
    proxy_metrics_url: str | None = Field(
        default=None,
        description=(
            "Where the overview reads the proxy's and the judge's counters (/metrics), every "
            "address the name resolves to (on Kubernetes, a headless Service: every replica). "
            "None: proxy_url, and judge.metrics_host and judge.metrics_port."
        ),
    )
    judge_metrics_url: str | None = Field(
        default=None,
        description=(
            "Where the overview reads the judge's counters (/metrics); unset: "
            "judge.metrics_host and judge.metrics_port."
        ),
    )
    allowed_hosts: list[str] = Field(
        default=[],
        description=(
            "The names browsers reach the console by (its Host header), besides loopback names, "
            "which are always allowed: any other Host is refused with 400, so a page whose name "
            "rebinds to the console's address (DNS rebinding) reads nothing. Host names or IP "
            'addresses, no port; "*.example.com" allows subdomains; "*" allows any. Off loopback, '
            "empty: any, with a warning."
        ),
    )
    session_ttl_s: int = Field(
        default=12 * 3600,
        ge=60,
        le=30 * 24 * 3600,
        description="How long a login lasts (seconds); logout ends it at once.",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        names = [host.strip().lower().removeprefix("[").removesuffix("]") for host in hosts]
        for name in names:
            if (
                name != "*"
                and not HOST_PATTERN.match(name.removeprefix("*."))
                and not is_ip_address(name)
            ):
                raise ValueError(
                    f"{name!r} is not a host name or IP address: write it as browsers send it "
                    "in Host, without scheme or port (e.g. console.example.com, *.example.com)"
                )
        return names
