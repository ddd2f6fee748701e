"""`ratchet console`: the web console. Server-rendered pages over the kernel's Redis keys and the
adapter store, live by polling, with the CLI's lifecycle actions behind the admin key."""
