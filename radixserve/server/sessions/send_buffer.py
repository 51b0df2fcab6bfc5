"""The frames one WebSocket connection has produced but not yet written to its socket, in bytes.

The reader and the generations of a connection queue frames here; one writer takes them out and
writes them. A client that stops reading blocks the writer (the transport pauses writing), so without
a bound everything the connection keeps producing would pile up in memory. Invariants:

- `pending_bytes` counts the UTF-8 size of every frame queued or being written (a frame counts until
  the writer reports it `sent`), and never exceeds `limit_bytes` — except for one frame on its own:
  a single frame larger than the limit is let through when nothing else is pending, so a large but
  legitimate reply (a long session's history) does not drop a client that reads.
- A frame that would push `pending_bytes` over the limit is not queued: the buffer is marked
  `overflowed`, everything still queued is dropped at once, and every later `put` is refused. The
  connection must then be closed (docs/protocol.md: close code 1008, reason "send buffer ...").
- Control items (close/stop markers for the writer) weigh nothing and are always queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Outgoing:
    """A queued frame (`text`) or a control marker for the writer (`control`, text empty)."""

    text: str
    size: int
    control: str | None = None


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class SendBuffer:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.pending_bytes = 0
        self.peak_bytes = 0
        self.overflowed = False
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()

    def put(self, text: str) -> bool:
        """Queue a frame; False (and the buffer overflows) when it does not fit."""
        if self.overflowed:
            return False
        size = utf8_size(text)
        if self.pending_bytes and self.pending_bytes + size > self.limit_bytes:
            self.overflowed = True
            self._drop_queued()
            return False
        self.pending_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)
        self._queue.put_nowait(Outgoing(text, size))
        return True

    def put_control(self, control: str) -> None:
        self._queue.put_nowait(Outgoing("", 0, control))

    async def get(self) -> Outgoing:
        return await self._queue.get()

    def sent(self, item: Outgoing) -> None:
        """The writer is done with `item` (written, or given up on): it no longer counts."""
        self.pending_bytes = max(0, self.pending_bytes - item.size)

    def _drop_queued(self) -> None:
        while not self._queue.empty():
            self.pending_bytes -= self._queue.get_nowait().size
        self.pending_bytes = 0  # the frame in the writer's hands is abandoned with the connection
