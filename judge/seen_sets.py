"""Where the judge's seen marks live: 63-bit integers in sharded Redis sets, one set per shard
and time bucket, so a mark costs about 8 bytes of Redis instead of a key of its own.

A key per prompt (``ratchet:judge:seen:<alias>:<sha256 hex>``, the version before) cost about
220 bytes of ``used_memory`` per judged exchange, most of it the key's name and the keyspace's
own entries. Here a mark is a member of an integer set, which Redis keeps as a sorted array of
8-byte integers while it holds at most ``set-max-intset-entries`` (512 by default) members:
:data:`SHARDS` sets per bucket keep that many up to about 70 marks a second per alias; past that
a set becomes a hash table of about 60 bytes a member, still a third of a key.

A mark is written into the set of the current bucket (:data:`BUCKETS_PER_WINDOW` buckets per
window), which expires one window after its bucket ends, and read from every bucket that can
still hold a mark of the window: a mark is therefore found for at least the window, and for at
most a bucket longer (1.25 windows).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

BUCKETS_PER_WINDOW = 4
SHARDS = 256
ANY_VERSION = 0  # the tag of "seen at all": a held-out prompt, or one sampled at any version
TAG_BITS = 16
DIGEST_BITS = 63 - TAG_BITS  # a member stays a signed 64-bit integer: Redis keeps it in an intset


def bucket_s(window_s: int) -> int:
    return max(1, math.ceil(window_s / BUCKETS_PER_WINDOW))


def set_key(alias: str, window_s: int, bucket: int, shard: int) -> str:
    """The bucket's length is in the name: a window changed in the config starts new sets
    (the old ones expire; a prompt may be judged once more, which loses nothing)."""
    return f"ratchet:judge:seen-sets:{alias}:{bucket_s(window_s)}:{bucket}:{shard}"


def shard_of(prompt_digest: str) -> int:
    return int(prompt_digest[-4:], 16) % SHARDS


def member(prompt_digest: str, version: int | None) -> int:
    """The prompt's first :data:`DIGEST_BITS` bits and a tag: :data:`ANY_VERSION`, or the
    version it was sampled from (mod 2^16 - 1, plus 1: a version 65,535 releases apart shares
    a tag, which no window spans). Two prompts share a member with odds about n/2^47."""
    digest = int(prompt_digest[:16], 16) >> (64 - DIGEST_BITS)
    tag = ANY_VERSION if version is None else version % (2**TAG_BITS - 1) + 1
    return digest << TAG_BITS | tag


def write_key(alias: str, prompt_digest: str, window_s: int, now: float) -> tuple[str, int]:
    """The set a mark goes to now, and its TTL: one window after its bucket ends."""
    length = bucket_s(window_s)
    bucket = int(now // length)
    ttl = (bucket + 1) * length + window_s - int(now)
    return set_key(alias, window_s, bucket, shard_of(prompt_digest)), ttl


def read_keys(alias: str, prompt_digest: str, window_s: int, now: float) -> Iterator[str]:
    """Every set that can hold a mark of the prompt made within the window."""
    length = bucket_s(window_s)
    shard = shard_of(prompt_digest)
    for bucket in range(int((now - window_s) // length), int(now // length) + 1):
        yield set_key(alias, window_s, bucket, shard)
