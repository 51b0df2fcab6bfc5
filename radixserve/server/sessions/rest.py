"""Session REST endpoints (/v1/sessions...) — the same sessions the WebSocket sees.

POST /v1/sessions/{id}/messages answers with one JSON object, or with `stream: true` an event stream
whose events are shaped like the WebSocket frames (start, delta, tool_call, done, error). A message is
a user message (`content`) or, with tools, the results of the last reply's calls (`tool_results`;
sessions/tools.py). Every endpoint acts
only on the caller's sessions, named by the X-Session-Owner header (see owners.py) under the caller's
tenant (a session of another tenant is unknown, even with its owner secret: callers.session_owner).
`cache_salt` on create is kept for every turn of the session; one on a message applies to that turn.
So is `chat_template_kwargs` (template variables, merged over the operator's --chat-template-kwargs:
pipeline/reasoning.py): on create it renders the session's first tokens and every turn, on a message
it is merged over the session's for that turn. A thinking model's reply carries its reasoning as the
message's `reasoning_content` (streamed: `delta` events whose `reasoning` holds a piece of it, with an
empty `text`) and its usage `reasoning_tokens`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.server.admission import client_of, hold_generation
from radixserve.server.api_errors import error_frame
from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.callers import cache_salt_of, caller_of, session_owner
from radixserve.server.http_util import ClientGone, EventStream, read_json_object, sse, until_done_or_gone
from radixserve.server.owners import Owner, mint_secret, secret_from_headers
from radixserve.server.pipeline.prediction import with_prediction
from radixserve.server.pipeline.reasoning import template_variables
from radixserve.server.pipeline.sampling import parse_sampling
from radixserve.server.pipeline.structured import with_structured
from radixserve.server.sessions.store import Message
from radixserve.server.sessions.tools import session_tools
from radixserve.server.sessions.turns import SessionTurn
from radixserve.server.state import ServerState
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def create_session(state: ServerState, body: dict[str, Any], secret: str | None, client: str | None,
                   caller: Caller) -> dict[str, Any]:
    """Shared with the WebSocket's session.create. The new session belongs to `secret`, or to a fresh one
    when the client sent none; either way the reply carries it as `owner`. A system prompt that leaves
    no room for a message and a reply within the context is refused: such a session could never chat.
    `client` (the peer's address) is charged one creation (429 rate_limited past its allowance). The
    session is the caller's tenant's, and keeps the body's `cache_salt` for its turns."""
    _, store = state.require_chat()
    context, cap = state.require_engine().max_model_len, state.config.max_prompt_tokens
    system_prompt = get_str(body, "system_prompt", required=False, allow_empty=True)
    salt = cache_salt_of(body)
    sampling = parse_sampling(body.get("sampling"))
    tools = session_tools(state, body)  # rendered into its first tokens, with the system prompt
    variables = template_variables(state, body.get("chat_template_kwargs"))  # ... and with these

    def room(shortest_prompt: int) -> None:
        if shortest_prompt >= context or (cap is not None and shortest_prompt > cap):
            limit = f" and prompts may have at most {cap} tokens (--max-prompt-tokens)" if cap is not None else ""
            raise ApiError("context_too_long", f"the system prompt leaves no room to chat: with the shortest message "
                           f"the prompt is {shortest_prompt} tokens, the model's context length is {context} "
                           f"tokens{limit}", param="system_prompt")

    state.limit_creation(client)  # after validation: a refused body costs no allowance
    secret = secret if secret is not None else mint_secret()
    owner = session_owner(secret, caller)
    assert owner is not None
    session = store.create(system_prompt, sampling, owner, room, tools, tenant=caller.tenant, cache_salt=salt,
                           template_vars=variables)
    return {**session.to_json(), "owner": secret}


def _owner(request: Request) -> Owner | None:
    """The session owner the request's X-Session-Owner names, bound to its caller's tenant."""
    return session_owner(secret_from_headers(request.headers), caller_of(request))


async def sessions_collection(request: Request) -> Response:
    state = _state(request)
    _, store = state.require_chat()
    if request.method == "GET":
        return JSONResponse({"sessions": [s.summary() for s in store.list(_owner(request))]})
    secret = secret_from_headers(request.headers)
    body = await read_json_object(request, state.config.max_message_bytes)
    return JSONResponse(create_session(state, body, secret, client_of(request), caller_of(request)), status_code=201)


async def session_item(request: Request) -> Response:
    state = _state(request)
    _, store = state.require_chat()
    sid, owner = request.path_params["session_id"], _owner(request)
    if request.method == "GET":
        return JSONResponse(store.get(sid, owner).to_json())
    session = store.delete(sid, owner)
    turn = state.session_generations.get(session.id)
    if turn is not None:
        turn.cancel()
    return Response(status_code=204)


async def fork_session(request: Request) -> Response:
    state = _state(request)
    _, store = state.require_chat()
    owner = _owner(request)
    body = await read_json_object(request, state.config.max_message_bytes)
    at = get_int(body, "at_message", minimum=0)
    if at is None:
        raise ApiError("missing_field", "missing required field 'at_message'", param="at_message")
    state.limit_creation(client_of(request))  # a fork is a new session too
    return JSONResponse(store.fork(request.path_params["session_id"], at, owner).to_json(), status_code=201)


async def post_message(request: Request) -> Response:
    """Refusals raise before any response starts, so they are JSON errors, never a stream."""
    state = _state(request)
    _, store = state.require_chat()
    owner = _owner(request)
    session = store.get(request.path_params["session_id"], owner)
    body = await read_json_object(request, state.config.max_message_bytes)
    content = get_str(body, "content") if body.get("tool_results") is None else None  # or tool results
    sampling = with_prediction(with_structured(parse_sampling(body.get("sampling")), body), body)
    stream = get_bool(body, "stream")
    priority = get_priority(body, priority_bounds(request_key(request.headers), state.config))
    store.get(session.id, owner)  # reading the body awaited: the session may have gone meanwhile
    hold_generation(request, state.generations, state.config)  # 429/503 over a cap, before tokenizing
    # tokenizing may await too: prepare fetches the session again after it
    turn = await SessionTurn.prepare(state, session.id, owner, content, sampling, gen_id="rest", priority=priority,
                                     body=body)
    if stream:
        return EventStream(_sse_events(state, turn))
    try:
        result = await until_done_or_gone(request.receive, _last_event(turn))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the turn ended with finish_reason "abort"
    message = turn.session.messages[result["message_index"]]
    return JSONResponse({"message": message_body(message),
                         "finish_reason": result["finish_reason"], "usage": result["usage"],
                         "timing": result["timing"], "message_index": result["message_index"],
                         "session_id": session.id})


def message_body(message: Message) -> dict[str, Any]:
    """A reply as POST .../messages returns it: OpenAI's assistant message (content null when it only calls;
    `reasoning_content` when the model thinks)."""
    thought = {"reasoning_content": message.reasoning} if message.reasoning is not None else {}
    if message.tool_calls:
        return {"role": "assistant", "content": message.content or None, **thought, "tool_calls": message.tool_calls}
    return {"role": "assistant", "content": message.content, **thought}


async def _last_event(turn: SessionTurn) -> dict[str, Any]:
    result: dict[str, Any] = {}
    async with aclosing(turn.events()) as events:
        async for ev in events:
            result = ev
    return result


async def _sse_events(state: ServerState, turn: SessionTurn) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(turn.events()) as events:
            async for ev in events:
                yield sse(ev)
    except Exception as e:  # the stream has started: the error is its last event
        yield sse(error_frame(e, state.metrics, gen_id=turn.gen_id))


ROUTES = [
    Route("/v1/sessions", sessions_collection, methods=["GET", "POST"]),
    Route("/v1/sessions/{session_id}", session_item, methods=["GET", "DELETE"]),
    Route("/v1/sessions/{session_id}/fork", fork_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}/messages", post_message, methods=["POST"]),
]
