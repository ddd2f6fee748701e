"""The note the ratings join keeps of each answer until its rating comes (learner/ratings.py).

Every exchange of an alias that joins ratings leaves one, for ``feedback.join_ttl_s``, so it is
kept small: tab-separated text, the key's hash as a 128-bit digest (ratchet/digests.py), the
prompt's hash packed as base64url, the client left out when it is the key itself, and the
alias last (the one free-form field). About 100 bytes, against about 300 for the JSON it
replaced; a JSON note (written before the upgrade) is still read, for its one TTL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ratchet.digests import key_digest, pack_hex, unpack_hex

FIELDS = 7


@dataclass(frozen=True)
class JoinNote:
    alias: str
    key: str  # the digest of the key that got the answer (ratchet.digests.key_digest)
    client: str  # the client it counts for; "" when that is the key itself
    prompt_hash: str  # hex
    version: int | None
    partition: int
    offset: int

    @classmethod
    def of(
        cls,
        alias: str,
        key_hash: str | None,
        client: str,
        prompt_hash: str,
        version: int | None,
        partition: int,
        offset: int,
    ) -> JoinNote:
        kept = "" if client == key_hash else client
        return cls(alias, key_digest(key_hash), kept, prompt_hash, version, partition, offset)

    def owned_by(self, key_hash: str | None) -> bool:
        """Whether ``key_hash`` is the key that got the answer."""
        return key_digest(key_hash) == self.key

    def client_for(self, key_hash: str | None) -> str | None:
        """The client the rating counts for, given the owner's (already checked) key hash."""
        return self.client or key_hash or None

    def encode(self) -> bytes:
        version = "" if self.version is None else str(self.version)
        fields = [self.key, self.client, pack_hex(self.prompt_hash), version]
        return "\t".join([*fields, str(self.partition), str(self.offset), self.alias]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> JoinNote:
        """A note as :meth:`encode` or the JSON join before it wrote it; a ValueError for
        anything else."""
        if raw.startswith(b"{"):
            return cls.decode_json(raw)
        parts = raw.decode().split("\t", FIELDS - 1)
        if len(parts) != FIELDS:
            raise ValueError(f"not a join note: {raw[:80]!r}")
        key, client, prompt, version, partition, offset, alias = parts
        return cls(
            alias,
            key,
            client,
            unpack_hex(prompt),
            int(version) if version else None,
            int(partition),
            int(offset),
        )

    @classmethod
    def decode_json(cls, raw: bytes) -> JoinNote:
        try:
            note = json.loads(raw)
            key_hash = str(note["key"])
            return cls.of(
                str(note["alias"]),
                key_hash,
                str(note.get("client") or ""),
                str(note["prompt_hash"]),
                note.get("version"),
                int(note["partition"]),
                int(note["offset"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a join note: {raw[:80]!r}") from exc
