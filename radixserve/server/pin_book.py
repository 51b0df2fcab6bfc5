"""The server's side of pinned prefixes: which pins it made, for which tenant, why, and until when.

The engine keeps the pins themselves (engine/pins.py: the held path, the budget, the hit counts);
this book adds what only the server knows: the tenant a pin was asked for (under global sharing
every namespace is the shared one), its origin (`api`, `file`: --pin at start, `cache_control`: an
Anthropic request), and when a cache_control pin expires. A prefix is pinned once per namespace:
asking again for the same tokens answers the pin that holds them (a cache_control request refreshes
its time to live; an operator's pin of it makes it permanent).

Invariants: every record names a pin the engine holds (records of pins gone from the engine are
forgotten at the next look); pins are made and expired one at a time (`lock`), so two requests for
one prefix never make two pins; `expires` is None except for cache_control pins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.chat.template import token_hash
from radixserve.engine.client import EngineClient, PinInfo

log = logging.getLogger("radixserve.server")
ORIGINS = ("api", "file", "cache_control")


@dataclass
class PinRecord:
    pin_id: str
    key: str  # the namespace and the prefix's token hash
    tenant: str
    origin: str  # one of ORIGINS
    expires: float | None  # time.monotonic() after which it is unpinned (cache_control's time to live)


class PinBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._records: dict[str, PinRecord] = {}
        self._clock = clock
        self._sweeper: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()

    def record(self, pin_id: str) -> PinRecord | None:
        return self._records.get(pin_id)

    def live(self, engine: EngineClient) -> list[tuple[PinInfo, PinRecord | None]]:
        """The engine's pins, each with its record (None: made by no request of this server)."""
        pins = engine.pins()
        held = {p.id for p in pins}
        for pin_id in [i for i in self._records if i not in held]:
            del self._records[pin_id]
        return [(p, self._records.get(p.id)) for p in pins]

    async def ensure(self, engine: EngineClient, tokens: list[int], namespace: str, tenant: str, label: str,
                     origin: str, ttl_s: float | None = None,
                     allow: Callable[[list[tuple[PinInfo, PinRecord | None]]], bool] | None = None,
                     ) -> tuple[PinInfo | None, bool]:
        """The pin holding `tokens` in `namespace`, made if there is none: (its info, whether it was
        made now). A cache_control pin (`ttl_s`) of an existing one pushes its expiry out; any other
        makes it permanent. `allow` (given the live pins) may refuse a new pin: (None, False). PinError
        from the engine (past the budget) propagates. Changes the cache."""
        key = f"{namespace}\x00{token_hash(tokens)}"
        async with self.lock:
            live = self.live(engine)
            for info, rec in live:
                if rec is not None and rec.key == key:
                    self._extend(rec, origin, ttl_s)
                    return info, False
            if allow is not None and not allow(live):
                return None, False
            info = await engine.pin(tokens, namespace, label)
            expires = None if ttl_s is None else self._clock() + ttl_s
            self._records[info.id] = PinRecord(info.id, key, tenant, origin, expires)
            if expires is not None:
                self._sweep_later(engine)
            return info, True

    def _extend(self, rec: PinRecord, origin: str, ttl_s: float | None) -> None:
        if ttl_s is None:  # an operator's pin of a prefix a cache_control pin holds: kept for good
            rec.expires, rec.origin = None, origin
        elif rec.expires is not None:
            rec.expires = max(rec.expires, self._clock() + ttl_s)

    async def remove(self, engine: EngineClient, pin_id: str) -> PinInfo | None:
        async with self.lock:
            self._records.pop(pin_id, None)
            return await engine.unpin(pin_id)

    async def expire(self, engine: EngineClient) -> list[PinInfo]:
        """Unpin every cache_control pin past its time to live; the pins released."""
        async with self.lock:
            now = self._clock()
            due = [r.pin_id for r in self._records.values() if r.expires is not None and r.expires <= now]
            released = []
            for pin_id in due:
                del self._records[pin_id]
                info = await engine.unpin(pin_id)
                if info is not None:
                    released.append(info)
            return released

    def wall_time(self, t: float) -> float:
        """A time of this book's clock (an `expires`) as Unix time."""
        return time.time() + t - self._clock()

    def next_expiry(self) -> float | None:
        times = [r.expires for r in self._records.values() if r.expires is not None]
        return min(times) if times else None

    def _sweep_later(self, engine: EngineClient) -> None:
        """Run the sweeper while some pin has a time to live (it ends when none has)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(engine))

    async def _sweep(self, engine: EngineClient) -> None:
        while (due := self.next_expiry()) is not None:
            await asyncio.sleep(max(0.05, due - self._clock()))
            try:
                for info in await self.expire(engine):
                    log.info("cache_control pin %s expired: unpinned %d tokens", info.id, info.tokens)
            except Exception:  # the engine stopping: the pins go with it
                log.debug("expiring cache_control pins failed", exc_info=True)
                return
