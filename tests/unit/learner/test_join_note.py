"""The ratings join's note per answer: small enough for Redis to keep in one allocation, and
the notes of the versions before (tab-separated with the prompt's hash; JSON) still read, for
their one TTL after an upgrade."""

from __future__ import annotations

import json

import pytest

from learner.join_note import JoinNote
from ratchet.digests import key_digest, pack_hex
from ratchet.records import prompt_hash
from ratchet.secrets import hash_api_key

KEY = hash_api_key(b"secret", "key-a")
OTHER = hash_api_key(b"secret", "key-b")
PROMPT = prompt_hash([{"role": "user", "content": "Q"}])
EMBSTR_MAX = 44  # Redis keeps a string value this short in one allocation with its header


def test_a_note_round_trips_and_fits_in_redis_smallest_string() -> None:
    note = JoinNote.of("my-alias", KEY, KEY or "", 2, 123_456_789)
    raw = note.encode()
    assert len(raw) <= EMBSTR_MAX, raw
    back = JoinNote.decode(raw)
    assert back == note
    assert back.owned_by(KEY) and not back.owned_by(OTHER) and not back.owned_by(None)
    assert back.client_for(KEY) == KEY  # the key itself is the client, though not stored


def test_a_vouched_users_client_and_a_keyless_note_are_kept() -> None:
    vouched = JoinNote.decode(JoinNote.of("a", KEY, "user:abc", 0, 1).encode())
    assert vouched.client_for(KEY) == "user:abc"
    keyless = JoinNote.decode(JoinNote.of("a", None, "-", 0, 1).encode())
    assert keyless.owned_by(None) and keyless.owned_by("") and not keyless.owned_by(KEY)
    assert keyless.client_for("") == "-"


def test_an_alias_with_a_tab_comes_back_whole() -> None:
    note = JoinNote.of("odd\talias", KEY, KEY or "", 0, 1)
    assert JoinNote.decode(note.encode()).alias == "odd\talias"


@pytest.mark.parametrize("alias", ["a", "odd\talias"])
def test_a_note_with_the_prompt_hash_written_before_is_read(alias: str) -> None:
    old = "\t".join([key_digest(KEY), "user:abc", pack_hex(PROMPT), "4", "1", "9", alias])
    note = JoinNote.decode(old.encode())
    assert (note.alias, note.partition, note.offset) == (alias, 1, 9)
    assert note.owned_by(KEY) and note.client_for(KEY) == "user:abc"


def test_a_json_note_written_before_the_upgrade_is_read() -> None:
    old = {
        "alias": "a",
        "key": KEY,
        "client": KEY,
        "prompt_hash": PROMPT,
        "version": 4,
        "partition": 1,
        "offset": 9,
    }
    note = JoinNote.decode(json.dumps(old).encode())
    assert note.owned_by(KEY) and not note.owned_by(OTHER)
    assert (note.alias, note.partition, note.offset) == ("a", 1, 9)
    assert note.client_for(KEY) == KEY


@pytest.mark.parametrize(
    "raw", [b"{not json", b'{"alias": "a"}', b"a\tb", b"k\t\t!!\t1\t0\t1\ta", b"k\t\t1\tx\ta"]
)
def test_what_no_version_wrote_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        JoinNote.decode(raw)
