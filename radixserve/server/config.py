"""Server configuration: every knob of the HTTP/WebSocket layer in one dataclass.

Engine knobs live in radixserve.config.EngineConfig; this holds only what the server itself enforces
(access, limits, sessions, sampling defaults). Validated on construction so a bad flag fails at start.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.engine.intake import PRIORITY_LIMIT
from radixserve.server.hosts import split_host
from radixserve.server.pin_target import PinTarget, check_tenant, known_tenants
from radixserve.server.tenants import DEFAULT_TENANT, SHARING_MODES, Caller, Role, TenantKey

DEFAULT_WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` listens on the loopback interface only."""
    name = host.strip().lower().strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token for /v1/* and the WebSocket: an admin of DEFAULT_TENANT
    # keys of tenants with roles (--api-keys FILE, loaded by the CLI: the config carries the keys, not the
    # path, so a replica elsewhere needs no file); with neither these nor api_key the server is open
    api_keys: list[TenantKey] = field(default_factory=list)
    cache_sharing: str = "tenant"  # "tenant": each tenant hits only its own prefixes; "global": all share
    # show system-prompt previews to unauthenticated callers (an open server); only on a loopback bind
    show_prompt_previews: bool = False
    pins: list[PinTarget] = field(default_factory=list)  # pinned once the model is loaded (--pin FILE)
    allowed_origins: list[str] = field(default_factory=list)  # extra WebSocket/CORS origins; "*" -> any
    # Host names answered besides the loopback names and the bound host ("name" any port, "name:port"); "*" -> any
    allowed_hosts: list[str] = field(default_factory=list)
    served_model_name: str | None = None  # name in /v1/models; None -> the engine's model name
    max_message_bytes: int = 256 * 1024  # one WebSocket frame or HTTP request body
    max_prompt_tokens: int | None = None  # None -> the model's context length is the only limit
    max_sessions: int = 1024
    max_session_bytes_total: int = 256 * 2**20  # all sessions' tokens (4 B each) + text; LRU idle ones go
    session_ttl_s: float = 3600.0  # idle time after which a session expires
    # Fairness (sessions/store.py, rate_limit.py): each owner's share of max_sessions and of max_session_bytes_total;
    # when the store is full the owner most over its share loses its least recently used idle session first
    owner_share: float = 0.25
    session_create_rate: float = 20.0  # session creations (and forks) a second per client address; 0 -> no limit
    session_create_burst: int = 100  # ... of which this many at once
    max_generations_per_connection: int = 8  # WebSocket generations in flight on one connection
    ws_send_buffer_bytes: int = 8 * 2**20  # frames waiting for a slow WebSocket client before it is dropped
    default_max_tokens: int = 512  # sessions/WebSocket when the client sets none (clamped to the context)
    default_temperature: float = 0.7
    default_top_p: float = 0.95
    max_n: int = 16  # OpenAI `n` at most
    # OpenAI logprob entries per request, n × max_tokens × (top_logprobs + 1): about 80 bytes of JSON
    # each, so the default bounds a body near 10 MiB (server/pipeline/logprobs.py)
    max_logprob_entries: int = 131072
    system_prompt_labels: int = 10  # Prometheus label values for system prompts besides "none"/"other"
    shutdown_grace_s: float = 5.0  # in-flight generations get this long to finish before they are aborted
    web_dir: Path | None = DEFAULT_WEB_DIR  # static UI served at /; None or missing -> no UI
    ws_auth_timeout_s: float = 10.0  # how long a keyed WebSocket may wait before its auth frame
    health_stall_s: float = 120.0  # /health is 503 after this long without an engine step while work waits
    replica_header: bool = False  # add x-radixserve-replica to HTTP responses (set by scaleout/ over replicas)
    # `priority` an ordinary caller may send (lower runs first under --policy priority); beyond it: a 400
    priority_range: tuple[int, int] = (-10, 10)
    # keys whose holders may send any priority (|p| <= 2**31); each is also accepted where --api-key is
    priority_api_keys: list[str] = field(default_factory=list)
    # Connections and load (connections.py, admission.py): a client must not hold sockets or generations unboundedly
    max_connections: int = 1024  # open sockets (HTTP + WebSocket); lowered to fit the descriptor limit
    header_timeout_s: float = 10.0  # a request head must arrive within this of the connection (or last response)
    body_timeout_s: float = 10.0  # ... and its body within this of the head
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_concurrent_generations: int = 512  # API requests generating at once, server-wide (503 beyond)
    max_generations_per_client: int = 64  # ... per client address (429 beyond)
    # grammar compiles one client address may have in flight (compile_slots.py; 429 beyond): below the
    # engine's compile workers, so one client's slow grammars cannot hold every worker
    max_compiles_per_client: int = 1
    # how tool calls look in the model's text (chat/tools/ FORMATS: hermes, llama3, mistral, ...); None -> the
    # format the chat template implies (server/openai_chat/tools.py)
    tool_call_parser: str | None = None
    # how replies of thinking models are split into reasoning and answer (chat/reasoning.py REASONING_PARSERS):
    # "auto" tells it from the chat template, "none" leaves the thinking inline
    reasoning_parser: str = "auto"
    # template variables every chat-shaped request renders with, under its own `chat_template_kwargs`
    # (e.g. {"enable_thinking": false}; server/pipeline/reasoning.py)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # stateless APIs pass prior assistant turns' reasoning, as clients send it back, to the template as
    # `reasoning_content` (templates that keep it then leave the cached prefix intact); else it is left out
    keep_reasoning_in_history: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive = {
            "max_message_bytes": self.max_message_bytes, "max_sessions": self.max_sessions,
            "session_ttl_s": self.session_ttl_s, "default_max_tokens": self.default_max_tokens,
            "max_generations_per_connection": self.max_generations_per_connection, "max_n": self.max_n,
            "max_logprob_entries": self.max_logprob_entries,
            "ws_auth_timeout_s": self.ws_auth_timeout_s, "health_stall_s": self.health_stall_s,
            "ws_send_buffer_bytes": self.ws_send_buffer_bytes, "max_session_bytes_total": self.max_session_bytes_total,
            "max_connections": self.max_connections, "header_timeout_s": self.header_timeout_s,
            "body_timeout_s": self.body_timeout_s, "keep_alive_timeout_s": self.keep_alive_timeout_s,
            "max_concurrent_generations": self.max_concurrent_generations,
            "max_generations_per_client": self.max_generations_per_client,
            "max_compiles_per_client": self.max_compiles_per_client,
        }
        if not 0.0 < self.owner_share <= 1.0:
            raise ValueError(f"owner_share must be in (0, 1], got {self.owner_share}")
        if self.session_create_rate < 0 or self.session_create_burst < 1:
            raise ValueError("session_create_rate must be >= 0 and session_create_burst >= 1")
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.system_prompt_labels < 0 or self.shutdown_grace_s < 0:
            raise ValueError("system_prompt_labels and shutdown_grace_s must be >= 0")
        if not 0.0 <= self.default_temperature <= 2.0 or not 0.0 < self.default_top_p <= 1.0:
            raise ValueError("default temperature must be in [0, 2] and default top_p in (0, 1]")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        low, high = self.priority_range
        if not -PRIORITY_LIMIT <= low <= high <= PRIORITY_LIMIT:
            raise ValueError(f"priority_range must be LOW,HIGH with -2**31 <= LOW <= HIGH <= 2**31, got {low},{high}")
        if not all(self.priority_api_keys):
            raise ValueError("priority API keys must not be empty")
        if self.cache_sharing not in SHARING_MODES:
            raise ValueError(f"cache_sharing must be one of {SHARING_MODES}, got {self.cache_sharing!r}")
        listed = [k.key for k in self.tenant_keys()]
        if len(set(listed)) != len(listed):
            raise ValueError("a key is given twice (--api-key, --priority-api-key and --api-keys must not overlap)")
        for pin in self.pins:  # a pin no key's requests could hit is a mistake (a typo in --pin FILE)
            check_tenant(pin.tenant or DEFAULT_TENANT, known_tenants(self.tenant_keys()))
        if self.show_prompt_previews and not is_loopback_host(self.host):
            raise ValueError(f"--show-prompt-previews shows system prompts to callers without a key, so it is only "
                             f"accepted when the server binds a loopback address, not {self.host!r}")
        self.allowed_origins = [o.strip().rstrip("/").lower() for o in self.allowed_origins if o.strip()]
        self.allowed_hosts = [h.strip().lower() for h in self.allowed_hosts if h.strip()]
        if self.tool_call_parser is not None:
            from radixserve.chat.tools import FORMATS  # the engine's formats, read only when one is named

            if self.tool_call_parser not in FORMATS:
                raise ValueError(f"tool_call_parser must be one of {sorted(FORMATS)}, got {self.tool_call_parser!r}")
        from radixserve.chat.reasoning import REASONING_PARSERS
        from radixserve.chat.template import RESERVED_VARIABLES

        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if not isinstance(self.chat_template_kwargs, dict) or not all(isinstance(k, str) and k
                                                                      for k in self.chat_template_kwargs):
            raise ValueError("chat_template_kwargs must be a JSON object with non-empty keys")
        try:  # JSON values only: they are template text, and a replica elsewhere gets them as JSON
            json.dumps(self.chat_template_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"chat_template_kwargs must hold JSON values only: {e}") from None
        reserved = sorted(RESERVED_VARIABLES & set(self.chat_template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server passes them itself")
        for h in self.allowed_hosts:
            if h != "*" and split_host(h) is None:
                raise ValueError(f"allowed_hosts entries are host names like example.com or example.com:8000 "
                                 f"(no scheme or path), got {h!r}")

    def tenant_keys(self) -> list[TenantKey]:
        """Every key the server accepts: the --api-keys file's, then --api-key and each --priority-api-key
        (admins of DEFAULT_TENANT). Empty (the server is open) without --api-key and --api-keys: priority
        keys alone only widen the priorities their holders may send, as before there were tenants."""
        if self.api_key is None and not self.api_keys:
            return []
        admin = Caller(DEFAULT_TENANT, Role.ADMIN)
        single = [self.api_key] if self.api_key is not None else []
        return [*self.api_keys, *(TenantKey(k, admin) for k in [*single, *self.priority_api_keys])]
