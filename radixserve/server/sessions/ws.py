"""The chat WebSocket (GET /v1/chat/ws): JSON frames as docs/protocol.md specifies.

One reader loop validates each client frame and answers malformed ones with an error frame (the
connection stays usable); each chat runs as its own task; one writer task owns the socket's send
side so frames from concurrent generations never interleave mid-frame. A disconnect cancels every
generation of the connection (the engine aborts them and frees their blocks) before the handler
returns; a turn already committed to its session is recorded there as a reply with finish_reason
"abort" (possibly empty), whether the disconnect came before its first token or after (sessions/turns.py).
A chat frame is validated in the reader (a refusal is an error frame with its gen_id); its
message is then tokenized in the generation's task (off the event loop when large: sessions/turns.py), and
that task is already a generation of the connection: it counts against the per-connection limit and
its gen_id, a `cancel` makes it end like any cancelled generation (`done`, finish_reason "abort"),
a disconnect ends it before anything is committed, and its slot is released exactly once.
The server closes the socket itself in two cases, both with 1008: an authentication failure, and a
client that does not read — the frames waiting for it (SendBuffer) would exceed
`ws_send_buffer_bytes`. Then the queued frames are dropped at once, the reader stops taking frames,
the connection's generations are aborted and the close frame is sent as soon as the socket takes it.
`req` is echoed on replies, so it must be small and shallow (validation.check_req).
Session frames name their owner in an `owner` field (owners.py); the connection's key (query
parameter or auth frame) makes its caller (callers.py): the tenant its sessions belong to and whose
cache its chats hit, narrowed by a session.create or chat frame's `cache_salt`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing, suppress
from functools import partial
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from radixserve.server.admission import Slot, client_of
from radixserve.server.api_errors import error_frame
from radixserve.server.auth import priority_bounds
from radixserve.server.callers import OPEN_CALLER, resolve_caller, session_owner, set_caller
from radixserve.server.http_util import dumps
from radixserve.server.owners import secret_from_frame
from radixserve.server.pipeline.prediction import with_prediction
from radixserve.server.pipeline.sampling import parse_sampling
from radixserve.server.pipeline.structured import with_structured
from radixserve.server.sessions.rest import create_session
from radixserve.server.sessions.send_buffer import SendBuffer
from radixserve.server.sessions.turns import SessionTurn, check_free
from radixserve.server.state import ServerState
from radixserve.server.validation import (
    ApiError,
    check_req,
    get_gen_id,
    get_priority,
    get_str,
    parse_json_text,
    require_object,
)

log = logging.getLogger("radixserve.server")
POLICY_VIOLATION = 1008
SLOW_CLIENT_REASON = "send buffer limit exceeded: the client is not reading"
CLOSE_WAIT_S = 10.0  # how long a close frame may wait for a stalled socket to take it
# how long a disconnect waits for its aborted generations to end on their own (the engine answers
# an abort within one step) before it cancels their tasks; either way each records its aborted turn
TEARDOWN_WAIT_S = 5.0
_CLOSE = "close"  # writer control: close the socket with 1008, then stop writing
_STOP = "stop"  # writer control: stop writing (the peer is gone or the handler is ending)


class Generation:
    """One chat of a connection, from its frame to its end: preparing (`turn` None), then running."""

    def __init__(self, gen_id: str, slot: Slot) -> None:
        self.gen_id, self.slot = gen_id, slot
        self.turn: SessionTurn | None = None
        self.cancelled = False  # a cancel frame came while preparing: the turn is cancelled once made
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self.turn is not None:
            self.turn.cancel()

    def stop(self) -> None:
        """The connection is ending: a preparing one is dropped before it commits anything."""
        if self.turn is not None:
            self.turn.cancel()
        elif self.task is not None:
            self.task.cancel()


class Connection:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws, self.state = ws, state
        self.outbox = SendBuffer(state.config.ws_send_buffer_bytes)
        self.generations: dict[str, Generation] = {}
        self.authed = not state.config.tenant_keys()  # an open server: every connection is OPEN_CALLER
        self.caller = OPEN_CALLER  # replaced by the key's caller when it authenticates
        self.priority_bounds = state.config.priority_range  # widened by a priority key (auth frame or query)
        self.closed = False
        self.stopped = asyncio.Event()  # wakes the reader when the connection must end
        self.writer_task: asyncio.Task[None] | None = None

    # -- sending -------------------------------------------------------------------------------
    def send(self, frame: dict[str, Any]) -> None:
        if not self.closed and not self.outbox.put(dumps(frame)):
            self._drop_slow_client()

    def _drop_slow_client(self) -> None:
        """The client is not reading: stop producing for it; _teardown closes with 1008."""
        self.closed = True
        self.state.metrics.ws_slow_client_disconnects.inc()
        log.warning("closing a WebSocket whose client is not reading (over the %d-byte send buffer)",
                    self.outbox.limit_bytes)
        if self.writer_task is not None:
            self.writer_task.cancel()  # it may be stuck waiting for the socket to take a frame
        self.stopped.set()

    def send_error(self, exc: Exception, gen_id: str | None = None, req: Any = None, has_req: bool = False) -> None:
        """An error frame for any exception (api_error_from logs an unexpected one, with the id it reports)."""
        self.send(error_frame(exc, self.state.metrics, gen_id, req, has_req))

    async def writer(self) -> None:
        while True:
            item = await self.outbox.get()
            if item.control == _STOP:
                return
            if item.control == _CLOSE:
                with suppress(Exception):
                    await self.ws.close(POLICY_VIOLATION)
                self.closed = True
                return
            try:
                await self.ws.send_text(item.text)
            except Exception:  # the peer is gone; the reader sees the disconnect
                self.closed = True
                return
            finally:
                self.outbox.sent(item)

    # -- receiving -----------------------------------------------------------------------------
    async def run(self) -> None:
        writer = self.writer_task = asyncio.create_task(self.writer())
        try:
            if "api_key" in self.ws.query_params and not self._authenticate(self.ws.query_params["api_key"]):
                return self._reject("invalid api_key query parameter")
            deadline = asyncio.get_running_loop().time() + self.state.config.ws_auth_timeout_s
            while not self.closed:
                timeout = None if self.authed else deadline - asyncio.get_running_loop().time()
                message = await self._receive(timeout)
                if self.closed:
                    return
                if message is None:
                    return self._reject("no auth frame in time")
                if message["type"] == "websocket.disconnect":
                    return
                if not self.handle(message):
                    return
        except WebSocketDisconnect:
            return
        finally:
            await self._teardown(writer)

    async def _receive(self, timeout: float | None) -> Mapping[str, Any] | None:
        """The next message, or None on timeout or once the connection is being dropped."""
        receive = asyncio.ensure_future(self.ws.receive())
        stopped = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait({receive, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not receive.done():
                receive.cancel()
        return receive.result() if receive.done() and not receive.cancelled() else None

    def _authenticate(self, key: object) -> bool:
        """Check a presented key: the connection acts as its caller from now on (its tenant, role); a
        priority key also widens the priorities this connection may send."""
        caller = resolve_caller(key, self.state.config)
        if caller is None:
            return False
        self.authed, self.caller, self.priority_bounds = True, caller, priority_bounds(key, self.state.config)
        set_caller(self.ws, caller)
        return True

    def _reject(self, why: str) -> None:
        self.send_error(ApiError("unauthorized", f"unauthorized: {why}", 401))
        self.outbox.put_control(_CLOSE)

    def handle(self, message: Mapping[str, Any]) -> bool:
        """Handle one received message; False once the connection must close."""
        has_req, req = False, None
        try:
            text = message.get("text")
            if text is None:
                raise ApiError("binary_frame", "binary frames are not accepted; send JSON text frames")
            frame = require_object(parse_json_text(text, self.state.config.max_message_bytes), "a frame")
            if "req" in frame:
                check_req(frame["req"])  # refused without an echo when it is not small and shallow
                has_req, req = True, frame["req"]
            kind = get_str(frame, "type")
            if not self.authed and (kind != "auth" or not self._authenticate(frame.get("api_key"))):
                self._reject("the first frame must be {\"type\":\"auth\",\"api_key\":...} with a valid key")
                return False
            self.dispatch(kind, frame, has_req, req)
        except Exception as e:  # a refused frame, or a bug: neither may take the connection down
            self.send_error(e, req=req, has_req=has_req)
        return True

    def dispatch(self, kind: str | None, frame: dict[str, Any], has_req: bool, req: Any) -> None:
        def reply(out: dict[str, Any]) -> None:
            self.send({**out, "req": req} if has_req else out)

        if kind == "ping":
            reply({"type": "pong"})
        elif kind == "auth":
            if not self._authenticate(frame.get("api_key")):
                raise ApiError("unauthorized", "wrong api_key", 401)
            reply({"type": "auth.ok"})
        elif kind == "session.create":
            reply({"type": "session.created",
                   "session": create_session(self.state, frame, secret_from_frame(frame), client_of(self.ws),
                                             self.caller)})
        elif kind == "session.resume":
            _, store = self.state.require_chat()
            session_id = get_str(frame, "session_id")
            owner = session_owner(secret_from_frame(frame), self.caller)
            reply({"type": "session.resumed", "session": store.get(session_id, owner).to_json()})
        elif kind == "chat":
            self.start_chat(frame, has_req, req)
        elif kind == "cancel":
            gen_id = get_str(frame, "gen_id")
            if gen_id not in self.generations:
                raise ApiError("unknown_gen_id", f"no generation {gen_id!r} in flight on this connection")
            self.generations[gen_id].cancel()
        else:
            raise ApiError("unknown_type", f"unknown frame type {kind!r}; expected one of auth, session.create, "
                           "session.resume, chat, cancel, ping")

    def start_chat(self, frame: dict[str, Any], has_req: bool, req: Any) -> None:
        gen_id = get_gen_id(frame)
        try:
            _, store = self.state.require_chat()
            session_id = get_str(frame, "session_id")
            # a user message, or (with tools) the results of the last reply's calls: checked in prepare
            content = get_str(frame, "content") if frame.get("tool_results") is None else None
            sampling = with_prediction(with_structured(parse_sampling(frame.get("sampling")), frame), frame)
            priority = get_priority(frame, self.priority_bounds)
            if gen_id in self.generations:
                raise ApiError("duplicate_gen_id", f"generation {gen_id!r} is already in flight on this connection")
            limit = self.state.config.max_generations_per_connection
            if len(self.generations) >= limit:
                raise ApiError("too_many_generations", f"at most {limit} generations may run on one connection", 429)
            owner = session_owner(secret_from_frame(frame), self.caller)
            check_free(session := store.get(session_id, owner))  # prepare checks again after tokenizing
            slot = self.state.generations.acquire(client_of(self.ws), self.state.config)  # before tokenizing
        except ApiError as e:
            self.send_error(e, gen_id=gen_id, req=req, has_req=has_req)
            return
        gen = self.generations[gen_id] = Generation(gen_id, slot)
        prepare = partial(SessionTurn.prepare, self.state, session.id, owner, content, sampling, gen_id, priority,
                          body=frame)
        gen.task = asyncio.create_task(self.run_generation(gen, prepare, has_req, req))

    async def run_generation(self, gen: Generation, prepare: Callable[[], Awaitable[SessionTurn]], has_req: bool,
                             req: Any) -> None:
        try:
            turn = gen.turn = await prepare()  # refused: an error frame with the gen_id and no start
            if gen.cancelled:
                turn.cancel()  # the engine aborts it on arrival: start, then done with "abort"
            async with aclosing(turn.events()) as events:
                async for ev in events:
                    self.send({**ev, "req": req} if has_req and ev["type"] == "start" else ev)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the error is the generation's last frame
            self.send_error(e, gen_id=gen.gen_id, req=req, has_req=has_req)
        finally:
            self.generations.pop(gen.gen_id, None)
            gen.slot.release()

    async def _teardown(self, writer: asyncio.Task[None]) -> None:
        """Abort this connection's generations (their blocks are freed) and stop the writer."""
        self.closed = True
        gens = list(self.generations.values())
        tasks = [g.task for g in gens if g.task is not None]
        for g in gens:
            g.stop()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=TEARDOWN_WAIT_S)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for g in gens:
            g.slot.release()  # a task cancelled before its first step never ran its own release
        if self.outbox.overflowed:
            with suppress(asyncio.CancelledError, Exception):
                await writer
            # the close frame waits until the socket takes data again (the client reads), then goes out
            with suppress(Exception):
                await asyncio.wait_for(self.ws.close(POLICY_VIOLATION, SLOW_CLIENT_REASON), CLOSE_WAIT_S)
            return
        self.outbox.put_control(_STOP)  # after any queued error frame and close
        try:
            await asyncio.wait_for(writer, 2.0)
        except (asyncio.TimeoutError, Exception):
            writer.cancel()


async def chat_websocket(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.server
    await ws.accept()  # Host and Origin were checked by RequestGuardMiddleware before the upgrade got here
    await Connection(ws, state).run()
