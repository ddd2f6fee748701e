"""The Responses store bounded and redacted, through a real proxy (beside the session's, with a
small per-key quota and two API keys), the real vLLM and the session's Redis, with the official
client: past its key's quota an answer is given and says ``store: false``, and is then unknown
to GET and to ``previous_response_id``, while another key stores as before and a delete gives
the room back; what is stored is redacted as the traffic log is, the answer given is not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai.types.responses import Response

from proxy.response_store import response_key
from tests.integration.conftest import ALIAS, Embedded
from tests.integration.side_proxy import side_proxy

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "sk-store-a", "sk-store-b"
# About 10 KB stored per response (the metadata is echoed in it, as OpenAI's): two fit in the
# quota, a third does not.
METADATA = {f"field{i:02d}": chr(ord("a") + i) * 512 for i in range(16)}
KEY_QUOTA = 26 * 1024


@pytest.fixture(scope="module")
def proxy_url(embedded: Embedded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    embedded.set_route(active=0, canary=None, canary_weight=0.0)
    home: Path = tmp_path_factory.mktemp("store-bounds")
    with side_proxy(
        embedded, home, api_keys=[KEY_A, KEY_B], responses_store_key_bytes=KEY_QUOTA
    ) as url:
        yield url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(llm: openai.OpenAI, text: str = "Say hi.", **more: Any) -> Response:
    return llm.responses.create(
        model=ALIAS, input=text, max_output_tokens=4, temperature=0, metadata=METADATA, **more
    )


def stored(response: Response) -> object:
    """The Response's ``store`` (OpenAI's field, which the SDK's type keeps as an extra)."""
    return (response.model_extra or {}).get("store")


def test_past_its_keys_quota_an_answer_is_not_stored_and_the_client_is_told(
    proxy_url: str,
) -> None:
    a, b = client(proxy_url, KEY_A), client(proxy_url, KEY_B)
    first, second = ask(a), ask(a)
    assert stored(first) is True and stored(second) is True
    assert a.responses.retrieve(second.id).id == second.id
    over = ask(a)
    assert over.output_text  # answered all the same
    assert stored(over) is False
    with pytest.raises(openai.NotFoundError) as unknown:
        a.responses.retrieve(over.id)
    assert "quota" in str(unknown.value)
    with pytest.raises(openai.NotFoundError):
        ask(a, "And then?", previous_response_id=over.id)
    # Another key is unaffected: its own quota, the same total.
    other = ask(b)
    assert stored(other) is True
    assert b.responses.retrieve(other.id).id == other.id
    # A delete gives the room back.
    a.responses.delete(first.id)
    again = ask(a)
    assert stored(again) is True
    continued = ask(a, "And then?", previous_response_id=again.id)
    assert continued.output_text is not None
    for response in (second, again, other):
        (a if response is not other else b).responses.delete(response.id)


def test_a_stored_response_is_redacted_and_the_answer_given_is_not(
    embedded: Embedded, proxy_url: str
) -> None:
    """The session's redact pattern (conftest.write_config) matches e-mail addresses."""
    llm = client(proxy_url, KEY_B)
    contact = {"contact": "ann@example.org"}
    given = llm.responses.create(
        model=ALIAS,
        input="Write to bob@example.com and say hi.",
        max_output_tokens=4,
        temperature=0,
        metadata=contact,
    )
    assert stored(given) is True and given.metadata == contact
    assert llm.responses.retrieve(given.id).metadata == {"contact": "[REDACTED]"}
    raw = redis.Redis.from_url(embedded.settings.redis_url).get(response_key(given.id))
    assert isinstance(raw, bytes)
    assert b"example." not in raw and b"Write to [REDACTED] and say hi." in raw
    # A continuation reads the redacted conversation: it is answered, from what was kept.
    continued = llm.responses.create(
        model=ALIAS, input="Again.", max_output_tokens=4, previous_response_id=given.id
    )
    assert continued.output_text is not None
    llm.responses.delete(given.id)
