"""The ``kafka`` section: how every service reaches the brokers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
)

from ratchet.settings.base import (
    _Section,
)


class KafkaSettings(_Section):
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        description="How clients connect to the brokers.",
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None,
        description="SASL mechanism, with a SASL_* security_protocol; unset: no SASL.",
    )
    sasl_username: str | None = Field(
        default=None,
        description="SASL user name.",
    )
    sasl_password: SecretStr | None = Field(
        default=None,
        description="SASL password (better from a secret file or RATCHET_KAFKA__SASL_PASSWORD).",
    )
    ssl_cafile: Path | None = Field(
        default=None,
        description="CA bundle that signs the brokers' certificates; unset: the system's.",
    )
    topic_partitions: int = Field(
        default=3,
        ge=1,
        description="Partitions of the topics Ratchet creates.",
    )
    topic_replication: int = Field(
        default=1,
        ge=1,
        description="Replication factor of the topics Ratchet creates.",
    )
    topic_retention_ms: int = Field(
        default=7 * 24 * 3600 * 1000,
        ge=60_000,
        description="How long the brokers keep records of the topics Ratchet creates (ms).",
    )
    compression: Literal["gzip", "snappy", "lz4", "zstd", "none"] = Field(
        default="gzip",
        description="gzip needs no native library, so it works on every machine the proxy runs on.",
    )
    idempotence: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            'Idempotent producing needs broker support (InitProducerId); "auto" probes for it.'
        ),
    )
    session_timeout_ms: int = Field(
        default=6000,
        ge=3000,
        le=300_000,
        description=(
            "How long a consumer group member may go silent before the broker drops it "
            "(heartbeats every third of it). A restarted judge or learner waits about this long "
            "for its group, so it is below kafka-python's 10 s "
            "(docs/results/settings-measurements.md)."
        ),
    )

    def client_options(self) -> dict[str, Any]:
        """Connection options shared by kafka-python producers, consumers and admin clients."""
        opts: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.sasl_mechanism:
            opts["sasl_mechanism"] = self.sasl_mechanism
            opts["sasl_plain_username"] = self.sasl_username
            opts["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        if self.ssl_cafile:
            opts["ssl_cafile"] = str(self.ssl_cafile)
        return opts
