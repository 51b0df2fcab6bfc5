"""Which replica each conversation lives on, as the ingress learnt it: the session affinity the
router honours (routing.py's `session` rule), kept per cache namespace.

A session's key (Placement.affinity, the chat session's id) is only meaningful inside the namespace
its requests read and write (SamplingParams.cache_namespace, the tenant's): so the map is keyed by
both, and one tenant's request naming another tenant's session id neither follows that session to its
replica nor moves it elsewhere. Free of Ray, so it is tested alone.

Invariants: at most `limit` entries, the least recently used forgotten first (a forgotten session
simply fails over to wherever the rule sends its next turn, and is recomputed there).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_AFFINITIES = 100_000


class SessionAffinity:
    def __init__(self, limit: int = MAX_AFFINITIES) -> None:
        self.limit = limit
        self._homes: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, namespace: str, key: str | None) -> str | None:
        """The replica the session `key` of `namespace` lives on, if known."""
        if key is None:
            return None
        replica = self._homes.get((namespace, key))
        if replica is not None:
            self._homes.move_to_end((namespace, key))
        return replica

    def set(self, namespace: str, key: str | None, replica: str) -> None:
        """The session's request was served by `replica`: its next turns go there."""
        if key is None:
            return
        self._homes[(namespace, key)] = replica
        self._homes.move_to_end((namespace, key))
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)
