"""Sampling a group: K fresh answers to one real prompt from the alias's live version.

Straight to vLLM, never through the proxy (the group must not be logged as traffic). vLLM's
``return_token_ids`` gives the exact prompt and completion token ids and ``logprobs`` the
behaviour log-probabilities, so the learner never re-tokenises anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from ratchet.answer_length import auto_max_tokens
from ratchet.answer_shaping import fixing_response_format
from ratchet.fleet import Replicas, conversation_key
from ratchet.records import Sample
from ratchet.replica_calls import call_timeout, never_connected, replica_fault
from ratchet.settings import SamplingConfig

# The turns that end a prompt: what follows them is the model's answer.
PROMPT_END_ROLES = frozenset({"user", "tool"})
# Served answer lengths the judge keeps per alias to size max_tokens: enough for a steady 95th
# percentile, few enough to follow a task whose answers change.
LENGTH_WINDOW = 256


class SamplingError(Exception):
    """vLLM could not produce the group; ``cause`` labels the failure metric. ``replica_fault``:
    the replica failed it (no connection, a 5xx, no answer within the deadline), a vote toward
    its ejection; ``never_connected``: vLLM never saw it, so another replica may be asked."""

    def __init__(
        self,
        cause: str,
        message: str,
        replica_fault: bool = False,
        never_connected: bool = False,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.replica_fault = replica_fault
        self.never_connected = never_connected


@dataclass(frozen=True)
class SampledGroup:
    prompt_token_ids: list[int]
    samples: list[Sample]
    # vLLM's usage: the prompt's tokens (prefilled once for the n answers) and the answers'.
    input_tokens: int = 0
    output_tokens: int = 0
    # The replica that sampled it (its base URL), for the learner's drift per replica.
    replica: str | None = None


def prompt_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation up to and including the last user or tool turn; None if there is none."""
    for end in range(len(messages) - 1, -1, -1):
        if messages[end].get("role") in PROMPT_END_ROLES:
            return messages[: end + 1]
    return None


def group_seed(seed: int, prompt_digest: str, version: int) -> int:
    """vLLM's seed for one group (``sampling.seed`` set): the same prompt on the same version
    gets the same seed. Under 2**30, as vLLM seeds the k-th answer of a group with seed + k."""
    mixed = hashlib.sha256(f"{seed}\0{prompt_digest}\0{version}".encode()).digest()
    return int.from_bytes(mixed[:4], "big") >> 2


def client_max_tokens(request: dict[str, Any]) -> int | None:
    """The answer length the client allowed (the smaller of ``max_completion_tokens`` and
    ``max_tokens`` when both are set); None when it set neither."""
    caps = [
        value
        for key in ("max_completion_tokens", "max_tokens")
        if isinstance(value := request.get(key), int) and not isinstance(value, bool) and value > 0
    ]
    return min(caps) if caps else None


def sampling_max_tokens(
    sampling: SamplingConfig, request: dict[str, Any], lengths: Sequence[int]
) -> int:
    """An explicit ``sampling.max_tokens`` wins; otherwise :func:`auto_max_tokens`."""
    if sampling.max_tokens is not None:
        return sampling.max_tokens
    return auto_max_tokens(lengths, client_max_tokens(request), sampling.max_tokens_cap)


def sampling_body(
    served_name: str,
    prompt: list[dict[str, Any]],
    request: dict[str, Any],
    group_size: int,
    sampling: SamplingConfig,
    seed: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """One request for the whole group: ``n`` answers share the prompt's prefill in vLLM.
    ``max_tokens``: from :func:`sampling_max_tokens` (None: that rule with no served lengths)."""
    body: dict[str, Any] = {
        "model": served_name,
        "messages": prompt,
        "n": group_size,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": (
            sampling_max_tokens(sampling, request, []) if max_tokens is None else max_tokens
        ),
        "logprobs": True,
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    # Tool definitions (and how the client asked to use them) travel with the prompt, and so
    # does the answer's format, unless it fixes the answer: then the client, not the model,
    # would write the K answers the group trains on (audit N-4). The proxy refuses such a
    # request on a learning alias; this guards records logged before, or while it did not learn.
    for key in ("tools", "tool_choice", "response_format"):
        if request.get(key) is not None:
            body[key] = request[key]
    if fixing_response_format(body.get("response_format")):
        del body["response_format"]
    return body


def parse_group(data: dict[str, Any], group_size: int) -> SampledGroup:
    prompt_ids = data.get("prompt_token_ids")
    choices = data.get("choices") or []
    if not isinstance(prompt_ids, list) or len(choices) != group_size:
        raise SamplingError("bad_response", f"expected {group_size} choices with token ids")
    samples = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        token_ids = choice.get("token_ids") or []
        logprobs = [
            entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []
        ]
        if not token_ids or len(token_ids) != len(logprobs):
            raise SamplingError("bad_response", "token ids and logprobs do not line up")
        message = {k: v for k, v in choice["message"].items() if v is not None}
        samples.append(
            Sample(
                message=message,
                text=message.get("content") or "",
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=choice.get("finish_reason"),
            )
        )
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return SampledGroup(
        prompt_token_ids=prompt_ids,
        samples=samples,
        input_tokens=_count(usage.get("prompt_tokens")),
        output_tokens=_count(
            usage.get("completion_tokens"), sum(len(s.token_ids) for s in samples)
        ),
    )


def _count(value: Any, default: int = 0) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )


async def sample_group(
    session: aiohttp.ClientSession,
    vllm_url: str,
    body: dict[str, Any],
    timeout_s: float,
    api_key: str,
    connect_timeout_s: float | None = None,
) -> SampledGroup:
    """``api_key``: the key vLLM requires (ratchet.secrets.vllm_api_key). ``timeout_s``: the
    whole answer's deadline (its first byte is its last: not streamed)."""
    try:
        async with session.post(
            vllm_url.rstrip("/") + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
            timeout=call_timeout(timeout_s, connect_timeout_s),
        ) as resp:
            payload = await resp.read()
            if resp.status != 200:
                raise SamplingError(
                    f"http_{resp.status}",
                    payload[:300].decode(errors="replace"),
                    replica_fault=resp.status >= 500,
                )
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise SamplingError(
            "vllm_unavailable",
            str(exc) or type(exc).__name__,
            replica_fault=replica_fault(exc),
            never_connected=never_connected(exc),
        ) from None
    return replace(parse_group(orjson.loads(payload), body["n"]), replica=vllm_url.rstrip("/"))


async def sample_from(
    replicas: Replicas,
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    timeout_s: float,
    api_key: str,
) -> SampledGroup:
    """The group from the replica chosen for its version (``body["model"]``), as the proxy
    chooses (ratchet/fleet.py), named in the group. Its outcome is told to ``replicas``: a
    failure of the replica's (no connection, a 5xx, no answer within ``timeout_s``) counts
    toward its ejection under the proxy's policy. A request that never connected is sent to
    the next replica, up to ``replicas.retries`` others; one that reached vLLM is not sent
    again: past ``timeout_s`` the group's time is spent (and the replica may be busy, not
    stalled: sending it on would double its load)."""
    tried: list[str] = []
    conversation = conversation_key(body)
    while True:
        async with replicas.use(body["model"], exclude=tried, conversation=conversation) as url:
            try:
                group = await sample_group(
                    session, url, body, timeout_s, api_key, replicas.connect_timeout_s
                )
            except SamplingError as exc:
                if exc.replica_fault:
                    replicas.failed(url, connected=not exc.never_connected)
                tried.append(url)
                if not exc.never_connected or not replicas.may_retry(tried, body["model"]):
                    raise
                continue
            replicas.succeeded(url)
            return group
