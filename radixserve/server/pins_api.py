"""Pinned prefixes over HTTP: POST /v1/cache/pins (pin the chat-templated start of a conversation for
a tenant), GET /v1/cache/pins (the pins and the budget), DELETE /v1/cache/pins/{id}; and the pins of
`--pin FILE`, made while the model loads (`pin_at_start`).

Access: making and removing pins takes an admin key (a user key: 403); a user key may list its own
tenant's pins, read-only, with its tenant's share of the budget. Labels (by default the start of the
system prompt) are shown only to callers who may see prompt previews (callers.sees_previews).

A pin for tenant T lives in T's cache namespace (`tenants.cache_namespace(T, None, sharing)`), the one
T's requests without a cache_salt read: they hit it; no other tenant's request can (under
`--cache-sharing global` every tenant's can). The tokens are those every chat with that system prompt
(or those messages) begins with (pin_prefix.py).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.engine.client import EngineClient, PinError, PinInfo
from radixserve.server.anthropic.cache_control import TENANT_SHARE
from radixserve.server.callers import caller_of, require_admin, sees_previews
from radixserve.server.http_util import read_json_object
from radixserve.server.pin_book import PinBook, PinRecord
from radixserve.server.pin_prefix import chat_prefix
from radixserve.server.pin_target import PinTarget, check_tenant, known_tenants, parse_target
from radixserve.server.state import ServerState
from radixserve.server.tenants import DEFAULT_TENANT, cache_namespace, is_salted, namespace_tenant
from radixserve.server.validation import ApiError


async def pin_target(state: ServerState, engine: EngineClient, target: PinTarget, tenant: str,
                     origin: str) -> tuple[PinInfo, bool]:
    """Pin what every chat of `tenant` beginning with the target's messages starts with: (the pin,
    whether it was made now). ValueError (PinError past the budget) when it cannot be."""
    if state.prompt_worker is None:
        raise ValueError("this model has no tokenizer, so it has no chat template to pin a prompt of")
    tokens = await chat_prefix(state.prompt_worker, list(target.messages))
    namespace = cache_namespace(tenant, None, state.config.cache_sharing)
    info, made = await state.pins.ensure(engine, tokens, namespace, tenant, target.label_or_default(), origin)
    assert info is not None  # nothing to `allow`
    return info, made


async def pin_at_start(state: ServerState, engine: EngineClient) -> None:
    """The pins of --pin FILE, once the engine runs and before any request is served; ValueError (the
    start fails) naming the pin that cannot be made."""
    if not state.config.pins:
        return
    for target in state.config.pins:
        tenant = target.tenant or DEFAULT_TENANT
        try:
            info, _ = await pin_target(state, engine, target, tenant, "file")
        except ValueError as e:
            raise ValueError(f"--pin {target.label_or_default()!r} (tenant {tenant}): {e}") from None
        budget = engine.pin_budget()
        # on the console with the other start-up lines (runner.py), which no logging setup hides
        print(f"radixserve: pinned {info.id} for tenant {tenant}: {info.tokens} tokens in {info.blocks} blocks (pins "
              f"hold {budget.used_blocks} of their {budget.budget_blocks} blocks): {info.label!r}", flush=True)


def _owner_tenant(info: PinInfo, record: PinRecord | None) -> str:
    """The tenant a pin was made for (a pin this server has no record of: its namespace's)."""
    return record.tenant if record is not None else namespace_tenant(info.namespace)


def pin_json(info: PinInfo, record: PinRecord | None, show_label: bool, book: PinBook) -> dict[str, Any]:
    tenant = _owner_tenant(info, record)
    expires = record.expires if record is not None else None
    return {
        "id": info.id, "object": "cache.pin", "tenant": tenant or None, "salted": is_salted(info.namespace),
        "origin": record.origin if record is not None else None, "tokens": info.tokens, "blocks": info.blocks,
        "hits": info.hits, "hit_tokens": info.hit_tokens, "created": int(info.created),
        "expires_at": None if expires is None else int(book.wall_time(expires)),
        "label": info.label if show_label else None,
    }


async def create_pin(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    require_admin(caller)
    body = await read_json_object(request, state.config.max_message_bytes)
    engine = state.require_engine()
    try:
        target = parse_target(body)
        tenant = target.tenant or caller.tenant
        check_tenant(tenant, known_tenants(state.config.tenant_keys()))
    except ValueError as e:
        raise ApiError("invalid_field", str(e)) from None
    state.require_chat()
    try:
        info, made = await pin_target(state, engine, target, tenant, "api")
    except PinError as e:
        raise ApiError("pin_refused", str(e)) from None
    except ValueError as e:
        raise ApiError("invalid_field", str(e)) from None
    body = pin_json(info, state.pins.record(info.id), sees_previews(caller, state.config), state.pins)
    return JSONResponse(body, status_code=201 if made else 200)


async def list_pins(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    engine = state.require_engine()
    await state.pins.expire(engine)
    show = sees_previews(caller, state.config)
    live = [(p, r) for p, r in state.pins.live(engine) if caller.is_admin or _owner_tenant(p, r) == caller.tenant]
    budget = engine.pin_budget()
    if caller.is_admin:
        figures = {"used_blocks": budget.used_blocks, "budget_blocks": budget.budget_blocks}
    else:  # its own pins against its tenant's share: nothing of other tenants' pins
        figures = {"used_blocks": sum(p.blocks for p, _ in live),
                   "budget_blocks": int(TENANT_SHARE * budget.budget_blocks)}
    return JSONResponse({"object": "list", "data": [pin_json(p, r, show, state.pins) for p, r in live], "budget": figures})


async def delete_pin(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    require_admin(caller)
    engine = state.require_engine()
    pin_id = request.path_params["pin_id"]
    record = state.pins.record(pin_id)
    info = await state.pins.remove(engine, pin_id)
    if info is None:
        raise ApiError("not_found", f"no pin {pin_id!r}", 404)
    return JSONResponse(pin_json(info, record, sees_previews(caller, state.config), state.pins))


ROUTES = [
    Route("/v1/cache/pins", create_pin, methods=["POST"]),
    Route("/v1/cache/pins", list_pins, methods=["GET"]),
    Route("/v1/cache/pins/{pin_id}", delete_pin, methods=["DELETE"]),
]
