"""The canary's claim on each canary-time answer: which arm answered it, so that its rating,
read by any learner replica, counts once for that arm (learner/canary_counter.py).

A claim per exchange is paid for by every exchange during a canary, so claims are not keys of
their own (about 240 bytes each with the key's name and TTL) but fields of small hashes: one per
canary, time slice (:data:`SLICE_S`) and shard (:data:`SHARDS`, by the completion id's digest),
``ratchet:canary:claims:<alias>:<slice>:<shard>``, each expiring :data:`COMPLETION_TTL_S` after
its slice ends. A shard this small stays in Redis's compact encoding (listpack, up to 128
fields): about 30 bytes a claim. Past about 100 canary requests a second a shard outgrows it and
a claim costs about 100 bytes, still less than a key.

A field is the completion id's 80-bit digest; its value the first :data:`OWNER_CHECK_CHARS`
characters of the answer's key digest (ratchet/digests.py), then the arm's initial and the
version, and for a user its key vouched for, a tab and that client (packed: under the 64 bytes
a compact field may hold); ``r`` once its rating is counted. The first exchange to claim an id
keeps it (the slices a claim may still be in are looked at first); a rating is counted at most
once, by one replica, in one script. The rating counts for the client of the rated answer,
never for one the rating names (audit N-14).

Claims written before (``ratchet:canary:completion:<id>``, a string key each) are still read and
counted once, until they expire (within :data:`COMPLETION_TTL_S` of the upgrade).
"""

from __future__ import annotations

import hashlib
import time
from datetime import datetime
from typing import Any

from ratchet.digests import key_digest, pack_hex, unpack_hex
from ratchet.records import TrafficRecord

# How long a canary-time claim is kept for its rating to be credited to its arm (at least this,
# at most one slice more).
COMPLETION_TTL_S = 3600
SLICE_S = 300
SHARDS = 256
OWNER_CHECK_CHARS = 8  # of the key's 128-bit keyed digest: 48 bits, which nobody can aim at
CLAIMS_PREFIX = "ratchet:canary:claims:"
RATED = b"r"
ARMS = {"canary": "c", "active": "a"}
ARM_OF = {initial: arm for arm, initial in ARMS.items()}
VOUCHED = "user:"  # a vouched user's client (ratchet.secrets.client_source): a 64-hex digest
PACKED_VOUCHED = "~"

# KEYS[1]: the record's slice shard; KEYS[2..n-1]: the other slices' shards a claim of this id
# may still be in; KEYS[n]: the id's claim key from before slices. ARGV: the field, the claim,
# when KEYS[1] expires (unix seconds). The first exchange to claim an id keeps it.
CLAIM_ANSWER_SCRIPT = """
if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return 0 end
for i = 2, #KEYS - 1 do
  if redis.call('HEXISTS', KEYS[i], ARGV[1]) == 1 then return 0 end
end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('EXPIREAT', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1..n-1]: the shards of every running canary's live slices; KEYS[n]: the id's claim key
# from before slices. ARGV: the field, the rater's owner check, the rater's key digest and whole
# key hash (as the claims from before hold them). Counts the rating when the completion was
# claimed, is not rated yet and went to the rater's key: marks it rated for every replica and
# returns {shard key, claim} (or, for a claim from before, the claim); 0 when the completion is
# not known (yet: its answer may still be on its way); else nil.
CLAIM_RATING_SCRIPT = """
for i = 1, #KEYS - 1 do
  local answered = redis.call('HGET', KEYS[i], ARGV[1])
  if answered then
    if answered == 'r' then return nil end
    if string.sub(answered, 1, #ARGV[2]) ~= ARGV[2] then return nil end
    redis.call('HSET', KEYS[i], ARGV[1], 'r')
    return {KEYS[i], answered}
  end
end
local answered = redis.call('GET', KEYS[#KEYS])
if not answered then return 0 end
if answered == 'rated' then return nil end
local owner = string.match(answered, '\t([^\t]*)$')
if owner ~= ARGV[3] and owner ~= ARGV[4] then return nil end
redis.call('SET', KEYS[#KEYS], 'rated', 'KEEPTTL')
return answered
"""


def legacy_key(completion_id: str) -> str:
    """A claim written before slices: "<alias>\\t<version>\\t<arm>\\t<client>\\t<key digest>",
    "rated" once counted, as its own key."""
    return f"ratchet:canary:completion:{completion_id}"


def field_of(completion_id: str) -> tuple[bytes, int]:
    """The id's field (80 bits of its digest: two ids that share it are out of reach) and
    shard."""
    digest = hashlib.blake2b(completion_id.encode(), digest_size=11).digest()
    return digest[:10], digest[10] % SHARDS


def shard_key(alias: str, slice_no: int, shard: int) -> str:
    return f"{CLAIMS_PREFIX}{alias}:{slice_no}:{shard}"


def alias_of(key: bytes) -> str:
    return key.decode(errors="replace")[len(CLAIMS_PREFIX) :].rsplit(":", 2)[0]


def owner_check(key_hash: str | None) -> str:
    """The start of the key's digest, always :data:`OWNER_CHECK_CHARS` long ("." is no digest's
    character: a key of none, or the anonymous ``-``, is padded with it)."""
    return key_digest(key_hash)[:OWNER_CHECK_CHARS].ljust(OWNER_CHECK_CHARS, ".")


def slice_of(seconds: float) -> int:
    return int(seconds) // SLICE_S


def live_slices(newest: int) -> range:
    """The slices, newest first, whose claims may still be kept at slice ``newest``."""
    return range(newest, newest - COMPLETION_TTL_S // SLICE_S - 2, -1)


def seconds_of(ts: str) -> float | None:
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def claim_answer(pipe: Any, record: TrafficRecord, arm: str) -> None:
    """Queue the claim of the record's answer for ``arm`` on a Redis pipeline, in the slice of
    the record's time (now, if unreadable), so that every replica puts it in the same place."""
    assert record.response_id is not None
    at = seconds_of(record.ts) or time.time()
    own = slice_of(at)
    field, shard = field_of(record.response_id)
    others = [shard_key(record.alias, s, shard) for s in live_slices(own + 1) if s != own]
    keys = [shard_key(record.alias, own, shard), *others, legacy_key(record.response_id)]
    claim = f"{owner_check(record.api_key_hash)}{ARMS[arm]}{record.version}"
    if record.client != (record.api_key_hash or ""):
        claim += "\t" + packed_client(record.client)
    expires = (own + 1) * SLICE_S + COMPLETION_TTL_S
    pipe.eval(CLAIM_ANSWER_SCRIPT, len(keys), *keys, field, claim, expires)


def claim_rating(pipe: Any, completion_id: str, rater: str | None, aliases: list[str]) -> None:
    """Queue the claim of a rating on a Redis pipeline: in the live slices of each of
    ``aliases`` (the running canaries), then in a claim from before slices."""
    field, shard = field_of(completion_id)
    newest = slice_of(time.time()) + 1  # a proxy's clock a little ahead of this one
    keys = [shard_key(a, s, shard) for a in aliases for s in live_slices(newest)]
    keys.append(legacy_key(completion_id))
    rater_hash = rater or ""
    pipe.eval(
        CLAIM_RATING_SCRIPT,
        len(keys),
        *keys,
        field,
        owner_check(rater),
        key_digest(rater_hash),
        rater_hash,
    )


def packed_client(client: str) -> str:
    digest = client.removeprefix(VOUCHED)
    if digest != client and len(digest) == 64:
        try:
            return PACKED_VOUCHED + pack_hex(digest)
        except ValueError:
            pass
    return client


def unpacked_client(packed: str) -> str:
    if packed.startswith(PACKED_VOUCHED):
        return VOUCHED + unpack_hex(packed[len(PACKED_VOUCHED) :])
    return packed


def claimed(answered: Any) -> tuple[str, int, str, str] | None:
    """What a counted rating's claim says: (alias, version, arm, the answer's client: "" for
    its key itself); None when not counted."""
    if isinstance(answered, list) and len(answered) == 2:
        key, value = answered
        said, _, client = value.decode(errors="replace")[OWNER_CHECK_CHARS:].partition("\t")
        arm = ARM_OF.get(said[:1])
        if arm is None or not said[1:].isdigit():
            return None
        return alias_of(key), int(said[1:]), arm, unpacked_client(client)
    if not isinstance(answered, bytes):
        return None  # rated already, another key's, or claimed by another replica
    alias, version, arm, *who = answered.decode(errors="replace").split("\t")
    # A claim from before: the client "" for the key itself (checked to be the rater's); a
    # claim written before clients were kept holds only its key.
    client = who[0] if who else ""
    return alias, int(version), arm, client
