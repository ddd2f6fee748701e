"""Ratchet's OpenAI-compatible proxy: routes aliases to adapter versions and logs every exchange."""
