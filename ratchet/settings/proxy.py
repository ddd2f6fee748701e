"""The ``proxy`` section: the OpenAI-compatible service, its limits and its log (its per-key
bounds and the Responses store's quota: ratchet/settings/proxy_bounds.py)."""

from __future__ import annotations

from typing import Any, Literal

import re2
from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from ratchet.settings.base import (
    _Section,
    is_loopback,
)
from ratchet.settings.proxy_bounds import (
    RESPONSES_STORE_KEY_BYTES,
    RESPONSES_STORE_MAX_BYTES,
    RESPONSES_STORE_TOTAL_BYTES,
    RESPONSES_STORE_TTL_S,
    RateLimitSettings,
)


class OutlierEjectionSettings(_Section):
    """`proxy.outlier_ejection`: a vLLM replica that keeps failing requests (no connection, a
    5xx, an answer cut off, a stream that stalls past `upstream_first_byte_timeout_s`) is left
    out of the rotation for a while, as a service mesh's outlier detection does
    (ratchet/ejection.py). Envoy's defaults, but for the share: a Ratchet fleet is a few GPU
    replicas, not hundreds of hosts. The judge's sampling and the learner's gate, which pick
    replicas themselves, follow it too (with upstream_retries and upstream_connect_timeout_s;
    their deadline is their own whole timeout)."""

    consecutive_failures: int = Field(
        default=5,
        ge=0,
        le=1000,
        description=(
            "Failures in a row that eject a replica (0: never eject). One that came back is "
            "ejected again at its first failure until it answers once."
        ),
    )
    base_ejection_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "An ejection lasts this times the number of times the replica was ejected (one "
            "fewer per max_ejection_s it then served), capped at max_ejection_s."
        ),
    )
    max_ejection_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="The longest one ejection lasts.",
    )
    max_ejection_percent: float = Field(
        default=50.0,
        ge=0,
        le=100,
        description=(
            "The most of the fleet ejected at once, in percent: at least one replica, never "
            "the last (a fault of every replica is not an outlier)."
        ),
    )


class ProxySettings(_Section):
    host: str = Field(
        default="127.0.0.1",
        description="Address the proxy listens on; other than loopback it needs api_keys.",
    )
    port: int = Field(
        default=8400,
        ge=1,
        le=65535,
        description="Port the proxy listens on.",
    )
    api_keys: list[SecretStr] = Field(
        default=[],
        description=(
            "Client keys. Empty means no auth, which is only allowed on a loopback address."
        ),
    )
    admin_key: SecretStr | None = Field(
        default=None,
        description=(
            "The operator's key: it reads /metrics (with metrics_auth), sees a canary's version, "
            "and signs in to the console, which needs it off loopback. Accepted as a client key."
        ),
    )
    user_vouching_keys: list[SecretStr] = Field(
        default=[],
        description=(
            "Keys of apps that tell their end users apart with the request's `user` field (and "
            "/v1/feedback's): for these the per-client caps (learning.max_key_share, the canary's "
            "and the reward model's per-client ratings) count each (key, user) as a client. Only "
            "list a key whose app sets `user` itself, never one handed to end users: they could "
            "then be anyone they like."
        ),
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Largest request body; a larger one is refused with 413.",
    )
    upstream_connect_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="How long connecting to vLLM may take.",
    )
    upstream_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long one request to vLLM may take in all.",
    )
    upstream_first_byte_timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        description=(
            "How long a request may wait for its first byte from vLLM (a stream's body, a "
            "whole answer's headers) before the replica's engine is probed with a one-token "
            "stream; only if that probe sends nothing within it too is the request a 504 "
            "upstream_stalled, counted against the replica (a busy engine, queueing or "
            "prefilling, is waited on). null: no deadline."
        ),
    )
    upstream_stream_gap_timeout_s: float | None = Field(
        default=30.0,
        gt=0,
        description=(
            "How long an answer may send nothing after its first byte (a gap between a "
            "stream's events) while the proxy is reading it before the replica's engine is "
            "probed as above; only if that probe sends nothing within it too does the answer "
            "end in upstream_stalled (a stream: an error event), counted against the replica. "
            "Far above a decode step under load, preempted ones included; a client that stops "
            "reading never counts. Checked by a sweep every quarter of it. null: no deadline."
        ),
    )
    upstream_retries: int = Field(
        default=2,
        ge=0,
        le=16,
        description=(
            "How many other replicas a request that never reached one (refused, unreachable, "
            "no connection within upstream_connect_timeout_s) is sent to. A request whose body "
            "went upstream is never sent again."
        ),
    )
    upstream_resolve_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description=(
            "How long resolving a vllm_endpoints name may take; past it, its last answer "
            "stands. Names are resolved apart from the health checks."
        ),
    )
    outlier_ejection: OutlierEjectionSettings = OutlierEjectionSettings()
    log_queue_size: int = Field(
        default=10_000,
        ge=1,
        description=(
            "Records accepted and not yet sent or spooled by the log worker process; past it, "
            "dropped."
        ),
    )
    redact_patterns: list[str] = Field(
        default=[],
        description=(
            "Regexes applied to every string a traffic record, a rating (its comment and ids), "
            "an export and a stored Response carry (request, its keys, `user`, client-chosen ids, "
            "error, answers) before it leaves the proxy; matches become [REDACTED], and a string "
            "with more than 1,000 matches is replaced whole. RE2 syntax (linear time): no "
            "backreferences or lookaround, and \\w, \\d, \\b are ASCII only (\\p{L} is a "
            "letter of any script)."
        ),
    )
    redact_budget_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description=(
            "Redaction time per record, checked at every match; past it, the strings not yet "
            "redacted are replaced whole, the record marked cut (no one learns from it) and "
            "counted (docs/results/hardening.md has what redaction costs)."
        ),
    )
    log_worker_stuck_s: float = Field(
        default=30.0,
        ge=1,
        le=3600,
        description=(
            "A log worker that holds frames and confirms none for this long is killed and "
            "replaced; the frame it was handling is dropped (reason worker_stuck). A healthy one "
            "confirms every 0.2 s."
        ),
    )
    registry_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="A full re-read of the routing table, on top of the pub/sub push.",
    )
    upstream_health_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="How often each vLLM replica's health is checked.",
    )
    balance: Literal["affinity", "version", "round_robin"] = Field(
        default="affinity",
        description=(
            'How a request\'s vLLM replica is chosen (vllm_endpoints): "affinity", by its served '
            "name with bounded loads and, once its version spreads, by its conversation "
            '(ratchet/fleet.py); "version", by served name alone; "round_robin", each in turn '
            "(the last two are bench/fleet_routing.py's peers; round-robin also suits a fleet "
            "that serves no adapters)."
        ),
    )
    expose_arm: bool = Field(
        default=False,
        description=(
            "Tell clients what answered them: the served name as the answer's model, the "
            "x-ratchet-version and x-ratchet-served-name headers and their canary arm "
            "(x-ratchet-canary-arm). Off: every answer names the alias only, the same with or "
            "without a canary, since a client that knew its arm could rate only that arm's "
            "answers."
        ),
    )
    # Per-key request rates and token budgets, shared by all replicas (proxy/ratelimit.py).
    rate_limit: RateLimitSettings = RateLimitSettings()
    metrics_auth: bool | None = Field(
        default=None,
        description=(
            "/metrics names aliases, versions, canary arms and traffic volumes: on, it needs the "
            "admin key. Unset: on unless host is loopback (off loopback without an admin key, "
            "nobody reads it)."
        ),
    )
    max_json_depth: int = Field(
        default=64,
        ge=2,
        le=128,
        description=(
            "Limits on one request, each refused with a 4xx that names it (proxy/validation.py). "
            "Nesting of the JSON body; deeper would cost recursion everywhere the body is walked, "
            "and orjson writes at most 254 levels."
        ),
    )
    max_json_items: int = Field(
        default=262_144,
        ge=1024,
        le=1 << 24,
        description=(
            "Values in all the body's objects and arrays together: what bounds its parsed size "
            "(each small value costs 30-100 bytes). Unknown fields pass through (vLLM and OpenAI "
            "clients send vendor fields), so this, not a field list, is the bound. Raise it only "
            "to send prompts of more token ids than this."
        ),
    )
    max_messages: int = Field(
        default=1024,
        ge=1,
        le=100_000,
        description="Chat messages per request; each one costs a walk and a line in the record.",
    )
    max_n: int = Field(
        default=16,
        ge=1,
        le=128,
        description="Choices per request: each one is a whole generation on vLLM.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description=(
            "max_tokens / max_completion_tokens; unset, the model's context (vLLM's max_model_len)."
        ),
    )
    max_choices: int = Field(
        default=64,
        ge=1,
        le=4096,
        description=(
            "n x prompts (a /v1/completions prompt list multiplies the work; chat has one prompt)."
        ),
    )
    max_answer_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=65536,
        le=1 << 30,
        description=(
            "A non-streamed answer is held whole in memory and copied to the log: past this, "
            "refused; a stream's log copy past this is dropped (the exchange is counted, not "
            "logged)."
        ),
    )
    max_record_bytes: int = Field(
        default=900 * 1024,
        ge=64 * 1024,
        le=64 * 1024 * 1024,
        description=(
            "The largest record the log worker produces. A bigger one (a long request, or an "
            "answer with n, top_logprobs or prompt_logprobs) is stored cut down and marked "
            "`truncated`, never dropped and never blocking others. Keep it below the broker's "
            "message.max.bytes (Kafka's default is 1 MiB); the producer's request limit is set 64 "
            "KiB above it."
        ),
    )
    spool_max_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=1 << 20,
        le=1 << 40,
        description=(
            "The disk spool's bound while Kafka is away: past it, newer records are dropped and "
            "counted (reason spool_full) and the oldest kept, so an outage never fills the "
            "volume."
        ),
    )
    log_queue_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=1 << 20,
        le=1 << 34,
        description=(
            "Bytes waiting for the log worker (on top of log_queue_size records): the pipe's "
            "memory."
        ),
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description=(
            "Slow clients (proxy/connection.py): the request line and headers must arrive within "
            "header_timeout_s of the connection or their first read, the body within "
            "body_timeout_s of the headers; a client that reads none of its answer for "
            "body_timeout_s is dropped."
        ),
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "How long a request body may take to arrive after its headers, and a client may "
            "read none of its answer."
        ),
    )
    keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description=(
            "An idle keep-alive connection is closed after this; behind a load balancer, keep it "
            "above the balancer's own idle timeout."
        ),
    )
    max_header_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        le=1 << 20,
        description="Request line + headers; llhttp itself has no limit.",
    )
    max_concurrency: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description=(
            "At this many open connections (or requests in progress), a new request gets 503."
        ),
    )
    responses_store_ttl_s: int = RESPONSES_STORE_TTL_S
    responses_store_max_bytes: int = RESPONSES_STORE_MAX_BYTES
    responses_store_key_bytes: int = RESPONSES_STORE_KEY_BYTES
    responses_store_total_bytes: int = RESPONSES_STORE_TOTAL_BYTES

    @field_validator("api_keys")
    @classmethod
    def _keys_not_blank(cls, keys: list[SecretStr]) -> list[SecretStr]:
        # A blank key (an unset environment variable) would match a request with no key at all.
        for index, key in enumerate(keys):
            if not key.get_secret_value().strip():
                raise ValueError(
                    f"key {index} is blank; remove it, or set it (an unset environment variable "
                    "gives a blank key)"
                )
        return keys

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_blank(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("is blank; remove it or set it to a real key")
        return key

    @model_validator(mode="after")
    def _vouching_keys_are_client_keys(self) -> ProxySettings:
        known = {k.get_secret_value() for k in self.api_keys}
        for index, key in enumerate(self.user_vouching_keys):
            if key.get_secret_value() not in known:
                raise ValueError(
                    f"proxy.user_vouching_keys[{index}] is not one of proxy.api_keys; a key can "
                    "only vouch for its users if it is a client key: add it to api_keys too"
                )
        return self

    @property
    def metrics_need_admin_key(self) -> bool:
        """Whether /metrics asks for the admin key: metrics_auth, else whether the proxy is
        reachable from beyond this machine."""
        return self.metrics_auth if self.metrics_auth is not None else not is_loopback(self.host)

    @model_validator(mode="after")
    def _metrics_auth_needs_admin_key(self) -> ProxySettings:
        if self.metrics_auth and self.admin_key is None:
            raise ValueError(
                "proxy.metrics_auth is on but proxy.admin_key is not set: nobody could read "
                "/metrics. Set proxy.admin_key (RATCHET_PROXY__ADMIN_KEY) or turn metrics_auth off"
            )
        return self

    @field_validator("redact_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                redaction_regex([pattern])
            except re2.error as exc:
                raise ValueError(
                    f"redact pattern {pattern!r} does not compile with RE2 ({_re2_reason(exc)}); "
                    "redaction uses RE2 so that it takes linear time: write it without "
                    "backreferences or lookaround (e.g. a character class instead of a lookahead)"
                ) from exc
        try:
            redaction_regex(patterns)
        except re2.error as exc:  # each compiles alone: together they are too large
            raise ValueError(
                f"the redact patterns together do not compile with RE2 ({_re2_reason(exc)}); "
                "use fewer or smaller patterns"
            ) from exc
        return patterns


def _re2_reason(exc: Exception) -> str:
    reason = exc.args[0] if exc.args else exc
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


def redaction_regex(patterns: list[str]) -> Any:
    """One RE2 regex matching any of ``patterns``: the log worker's redaction (linear time in
    the text, whatever the pattern). Raises ``re2.error`` for what RE2 cannot compile."""
    options = re2.Options()
    options.log_errors = False  # the error is raised (and reported with its pattern), not logged
    return re2.compile("|".join(f"(?:{p})" for p in patterns), options)
