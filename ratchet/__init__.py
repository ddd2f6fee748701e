"""Ratchet's shared kernel: settings, record types, the Kafka bus, the Redis registry, the adapter
store, the CLI and the embedded stack. The services (proxy, judge, learner) meet only here."""

__version__ = "0.1.0"
