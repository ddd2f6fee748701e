"""How far behind a group's sampling version is: the lineage walk.

A group sampled by version ``v`` may train the next round only if ``v`` lies on the path to where
that round starts (ratchet/carry.py :class:`~ratchet.carry.Start`): back along the carried
candidates it trains on from (each one's ``trained_from``) to the live version, then along the
live version's promotions (each one's ``parent_version``). The number of steps on that path is
the group's *policy lag*; a version off the path (a sibling, a rolled-back version, a candidate
no longer carried) has none and its groups are stale.

Both links are read from each version's folder in the adapter store, which never changes once
written, so each is read once and kept.
"""

from __future__ import annotations

from ratchet.carry import Start
from ratchet.store import AdapterStore

# A live version's ancestry longer than this is taken as a corrupt store, not walked further.
MAX_PROMOTIONS = 1000


class Lineage:
    """The versions' links, read from the store once each."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        self._parents: dict[tuple[str, int], int | None] = {}  # each version's parent_version
        self._sources: dict[tuple[str, int], int | None] = {}  # each one's trained_from

    def policy_lag(self, alias: str, version: int, live: int, start: Start) -> int | None:
        """Rounds of training between the version that sampled a group and ``start``, where the
        next round starts: back along the carried candidates it trained on from (each one's
        ``trained_from``) to the live version, then along the live version's promotions. None:
        not on that path (a sibling, a rolled-back version, a candidate no longer carried)."""
        current, lag = start.version, 0
        while current != live:
            if current == version:
                return lag
            trained_from = self._link(self._sources, "trained_from", alias, current)
            if trained_from is None or lag >= start.rounds:
                return None
            current, lag = trained_from, lag + 1
        behind = self.promotions_between(alias, version, live)
        return None if behind is None else behind + lag

    def promotions_between(self, alias: str, version: int, live: int) -> int | None:
        """How many versions of the live one's lineage came after ``version`` (None: it is not
        an ancestor of the live version, e.g. a version that was rolled back)."""
        steps, current = 0, live
        while current != version:
            if current == 0 or steps > MAX_PROMOTIONS:
                return None
            parent = self._link(self._parents, "parent_version", alias, current)
            if parent is None:
                return None
            current, steps = parent, steps + 1
        return steps

    def _link(
        self, known: dict[tuple[str, int], int | None], field: str, alias: str, version: int
    ) -> int | None:
        """``field`` of the version's metadata (None: not in the store, or not set)."""
        key = (alias, version)
        if key not in known:  # a version's folder never changes once written
            value = None
            if self.store.exists(alias, version):
                value = self.store.meta(alias, version).get(field)
            known[key] = None if value is None else int(value)
        return known[key]
