"""Keeping a quiet stream alive: the items of an async iterator, with a tick (None) whenever it has
yielded nothing for an interval, so that the Anthropic stream (api.py) can send `ping` events while
the engine prefills a long prompt and clients and proxies that drop idle connections keep waiting.

Invariants: the source's items come in order, each exactly once; ticks come only while an item is
awaited, one per `interval` without one; the source is advanced on its own task (waiting for the
tick must not cancel a pending step: cancelling an engine stream aborts its request), and that task
is cancelled when the caller closes the pacing generator, so a client going away still aborts the
generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import suppress
from typing import Any, TypeVar

T = TypeVar("T")


async def paced(source: AsyncIterator[T], interval: float) -> AsyncGenerator[T | None, None]:
    """`source`'s items, and a None after each `interval` seconds in which it yielded none."""
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            step, pending = pending, None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the caller left while a step was awaited: end it (the engine request with it)
            pending.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await pending
