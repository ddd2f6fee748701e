"""The note the ratings join keeps of each answer until its rating comes (learner/ratings.py).

Every exchange of an alias that joins ratings leaves one, for ``feedback.join_ttl_s``, so it is
kept small: tab-separated text, the key's hash as a 128-bit digest (ratchet/digests.py), the
client left out when it is the key itself, where the answer is in ``ratchet.traffic`` (partition
and offset), and the alias last (the one free-form field). Nothing that the record itself
carries (its prompt's hash, its version): the join reads the record anyway, at hand or back from
Kafka. About 40 bytes, so Redis keeps it in one allocation with its header; notes written before
(with the prompt's hash and the version: about 100 bytes; or JSON, about 300) are still read,
for their one TTL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ratchet.digests import key_digest, unpack_hex

FIELDS = 5
BEFORE_FIELDS = 7  # key, client, packed prompt hash, version, partition, offset, alias


@dataclass(frozen=True)
class JoinNote:
    alias: str
    key: str  # the digest of the key that got the answer (ratchet.digests.key_digest)
    client: str  # the client it counts for; "" when that is the key itself
    partition: int
    offset: int

    @classmethod
    def of(
        cls, alias: str, key_hash: str | None, client: str, partition: int, offset: int
    ) -> JoinNote:
        kept = "" if client == key_hash else client
        return cls(alias, key_digest(key_hash), kept, partition, offset)

    def owned_by(self, key_hash: str | None) -> bool:
        """Whether ``key_hash`` is the key that got the answer."""
        return key_digest(key_hash) == self.key

    def client_for(self, key_hash: str | None) -> str | None:
        """The client the rating counts for, given the owner's (already checked) key hash."""
        return self.client or key_hash or None

    def encode(self) -> bytes:
        fields = [self.key, self.client, str(self.partition), str(self.offset), self.alias]
        return "\t".join(fields).encode()

    @classmethod
    def decode(cls, raw: bytes) -> JoinNote:
        """A note as :meth:`encode`, or a version before it, wrote it; a ValueError for
        anything else."""
        if raw.startswith(b"{"):
            return cls.decode_json(raw)
        text = raw.decode()
        parts = text.split("\t", FIELDS - 1)
        # The notes before kept the packed prompt hash third: never all digits, as a partition.
        if len(parts) == FIELDS and parts[2].isdigit() and parts[3].isdigit():
            key, client, partition, offset, alias = parts
            return cls(alias, key, client, int(partition), int(offset))
        parts = text.split("\t", BEFORE_FIELDS - 1)
        if len(parts) != BEFORE_FIELDS or not parts[4].isdigit() or not parts[5].isdigit():
            raise ValueError(f"not a join note: {raw[:80]!r}")
        key, client, prompt, _version, partition, offset, alias = parts
        unpack_hex(prompt)  # a ValueError for what no version wrote
        return cls(alias, key, client, int(partition), int(offset))

    @classmethod
    def decode_json(cls, raw: bytes) -> JoinNote:
        try:
            note = json.loads(raw)
            key_hash = str(note["key"])
            return cls.of(
                str(note["alias"]),
                key_hash,
                str(note.get("client") or ""),
                int(note["partition"]),
                int(note["offset"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a join note: {raw[:80]!r}") from exc
