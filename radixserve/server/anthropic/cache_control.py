"""Anthropic's `cache_control` on /v1/messages: a system block marked `{"type": "ephemeral"}` asks
for the system prompt (`system`, with any leading system messages of `messages` joined to it:
request.py) to stay cached, which here means a pin (pin_book.py) of the tokens every chat
with that system prompt (and those tools) begins with, in the request's own cache namespace, for
the block's time to live: 5 minutes, or an hour with `"ttl": "1h"` (Anthropic's two), pushed out by
every request that asks again. Past it the pin is released and the prefix is an ordinary LRU entry.

Quota, as Anthropic caches "best effort": a tenant's cache_control pins may hold TENANT_SHARE of the
pin budget, and all tenants' together TOTAL_SHARE (the rest stays the operator's); a request over
its quota, or past the budget, is served without a pin and without an error. The radix cache still
caches every prefix, marked or not; the mark only protects it from eviction.

Usage (reply.py), as docs/pins.md and Anthropic's cache count it: the request that made
the pin reports the pin's tokens as `cache_creation_input_tokens` (written to the pinned cache for
it, also where an unmarked request had happened to cache them before), and the rest of what the
cache served as `cache_read_input_tokens`; every other request reports 0 created.

Invariants: only `system` blocks are read for a mark (a mark elsewhere is accepted and changes
nothing); a mark is checked (type, ttl) before anything is pinned; a refused pin never fails the
request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from radixserve.engine.pins import PinInfo
from radixserve.server.anthropic.request import MessagesRequest
from radixserve.server.pin_book import PinRecord
from radixserve.server.pin_prefix import chat_prefix
from radixserve.server.pin_target import PinTarget
from radixserve.server.pipeline.ask import ChatPrompt
from radixserve.server.state import ServerState
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError

log = logging.getLogger("radixserve.server")
TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's times to live; the first is the default
TENANT_SHARE = 0.25  # of the pin budget: one tenant's cache_control pins at most
TOTAL_SHARE = 0.5  # ... and all tenants' together


def requested_ttl(system: Any) -> float | None:
    """The longest time to live the `system` field's blocks ask for (None: no mark); 400 for a bad mark."""
    if not isinstance(system, list):
        return None
    ttl: float | None = None
    for k, block in enumerate(system):
        mark = block.get("cache_control") if isinstance(block, dict) else None
        if mark is None:
            continue
        where = f"system[{k}].cache_control"
        if not isinstance(mark, dict) or mark.get("type") != "ephemeral" or set(mark) - {"type", "ttl"}:
            raise ApiError("invalid_field", f"{where} must be {{\"type\": \"ephemeral\"}} with an optional \"ttl\"",
                           param=where)
        asked = mark.get("ttl", "5m")
        if asked not in TTLS:
            raise ApiError("invalid_field", f"{where}.ttl must be one of {list(TTLS)}, got {asked!r}", param=f"{where}.ttl")
        ttl = max(ttl or 0.0, TTLS[asked])
    return ttl


def _within_quota(tenant: str, need_blocks: int, budget_blocks: int) -> Callable[[list[tuple[PinInfo, PinRecord | None]]], bool]:
    def allow(live: list[tuple[PinInfo, PinRecord | None]]) -> bool:
        marked = [(p, r) for p, r in live if r is not None and r.origin == "cache_control"]
        mine = sum(p.blocks for p, r in marked if r is not None and r.tenant == tenant)
        everyone = sum(p.blocks for p, _ in marked)
        return (mine + need_blocks <= TENANT_SHARE * budget_blocks
                and everyone + need_blocks <= TOTAL_SHARE * budget_blocks)
    return allow


async def keep_marked_system(state: ServerState, body: dict[str, Any], caller: Caller, req: MessagesRequest) -> int:
    """Pin the system prompt of a request whose system blocks carry cache_control (see the module
    docstring): the pin's tokens when this request made it (0 when it was pinned before, or is not pinned)."""
    ttl = requested_ttl(body.get("system"))
    engine, chat_tools = state.require_engine(), req.plan.ask.tools
    assert isinstance(req.plan.ask.prompt, ChatPrompt)
    messages = req.plan.ask.prompt.messages
    tools = chat_tools.template_tools() if chat_tools is not None else None
    namespace = req.plan.params.cache_namespace
    if ttl is None or not messages or messages[0]["role"] != "system":
        return 0
    try:
        tokens = await chat_prefix(state.require_prompts(), messages[:1], tools)
        allow = _within_quota(caller.tenant, -(-len(tokens) // engine.block_size), engine.pin_budget().budget_blocks)
        label = PinTarget(tuple(messages[:1]), caller.tenant).label_or_default()
        info, made = await state.pins.ensure(engine, tokens, namespace, caller.tenant, label, "cache_control", ttl, allow)
    except ValueError as e:  # past the budget (PinError), or a template that will not render it alone
        log.debug("cache_control: no pin for tenant %s: %s", caller.tenant, e)
        return 0
    return info.tokens if made and info is not None else 0
