"""Client faults in uvicorn's log: what a misbehaving client causes is one INFO line, not an ERROR.

uvicorn's WebSocket protocol (websockets-sansio) logs two client-caused events as server errors:

- "ASGI callable returned without completing handshake." after the app refused an upgrade with an
  HTTP response (request_guard's 400/403/421): the ASGI spec counts that response as the end of the
  handshake, uvicorn does not mark it so;
- "Invalid UTF-8 sequence received from client." with a traceback, for a text frame that is not
  UTF-8 (the connection is then closed with 1007, as RFC 6455 asks, which is all there is to do).

`ClientFaultFilter`, on the "uvicorn.error" logger, turns exactly those records into one INFO line
without a traceback, and drops them when that logger is not enabled for INFO (the server runs uvicorn
at "warning"), so a client cannot fill the log with tracebacks. Every other record passes unchanged:
real failures keep their ERROR and traceback. Invariant: `install` is idempotent (one filter however
many apps a process builds).
"""

from __future__ import annotations

import logging

UVICORN_ERROR_LOGGER = "uvicorn.error"
# uvicorn's message (matched by its start) -> what the line says instead
CLIENT_FAULTS = {
    "ASGI callable returned without completing handshake": "WebSocket upgrade refused with an HTTP error response",
    "Invalid UTF-8 sequence received from client": "WebSocket closed (1007): the client sent a text frame that "
                                                   "is not UTF-8",
}


class ClientFaultFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        said = record.msg if isinstance(record.msg, str) else ""
        line = next((text for start, text in CLIENT_FAULTS.items() if said.startswith(start)), None)
        if line is None:
            return True
        record.msg, record.args = line, ()
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


def install() -> None:
    """Put the filter on uvicorn's error logger once (logging config later adds, never removes, filters)."""
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    if not any(isinstance(f, ClientFaultFilter) for f in logger.filters):
        logger.addFilter(ClientFaultFilter())
