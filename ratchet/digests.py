"""Short spellings of the project's hex digests, for what Redis keeps per exchange.

A note kept per answer is paid for by every exchange, so it spells a key's hash as 128 bits of
base64url (22 characters, not the 76 of ``hmac-sha256:<hex>``): enough that nobody finds another
key with the same digest, since the hash is keyed by the server's secret. A digest that must
come back whole is packed losslessly instead (the join notes written before kept the prompt's
hash so: they are still read, for their one TTL).
"""

from __future__ import annotations

import base64
import binascii

KEY_DIGEST_BYTES = 16  # 128 bits of the keyed hash: a second key with the same digest is infeasible


def key_digest(key_hash: str | None) -> str:
    """``hmac-sha256:<hex>`` (ratchet.secrets.hash_api_key) as 128 bits of base64url; anything
    else (no key, the anonymous ``-``) as it is."""
    if not key_hash:
        return ""
    _, _, hexdigest = key_hash.rpartition(":")
    try:
        raw = bytes.fromhex(hexdigest)
    except ValueError:
        return key_hash
    return pack_bytes(raw[:KEY_DIGEST_BYTES]) if len(raw) >= KEY_DIGEST_BYTES else key_hash


def pack_bytes(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def pack_hex(hexdigest: str) -> str:
    """A hex digest as base64url without padding (64 hex characters: 43)."""
    return pack_bytes(bytes.fromhex(hexdigest))


def unpack_hex(packed: str) -> str:
    """:func:`pack_hex`'s inverse; a ValueError for what it did not write."""
    try:
        padded = packed + "=" * (-len(packed) % 4)
        raw = base64.b64decode(padded, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not a packed digest: {packed!r}") from exc
    if not raw:
        raise ValueError("an empty digest")
    return raw.hex()
