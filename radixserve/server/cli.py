"""Flags of `radixserve serve` (the engine flags come from radixserve.cli) and its entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from radixserve.chat.reasoning import REASONING_PARSERS
from radixserve.chat.tools import FORMATS
from radixserve.config import EngineConfig
from radixserve.server.config import DEFAULT_WEB_DIR, ServerConfig
from radixserve.server.pin_target import load_pin_file
from radixserve.server.tenants import SHARING_MODES, load_api_keys


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address (default %(default)s: loopback only)")
    g.add_argument("--port", type=int, default=d.port, help="TCP port, 0 for any free one (default %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="require this key: `Authorization: Bearer KEY` over HTTP, `?api_key=KEY` or an auth "
                        "frame on the WebSocket; an admin key of the tenant 'default' (default: none; env "
                        "RADIXSERVE_API_KEY)")
    g.add_argument("--api-keys", default=None, metavar="FILE",
                   help="keys of tenants: one `KEY TENANT ROLE` per line (ROLE admin or user, `#` comments); each "
                        "tenant's requests hit only its own cached prefixes, a user key sees only its own tenant's "
                        "cache figures (docs/tenants.md) (default: none; env RADIXSERVE_API_KEYS_FILE)")
    g.add_argument("--cache-sharing", default=d.cache_sharing, choices=SHARING_MODES,
                   help="tenant: a request hits only prefixes its own tenant cached; global: every tenant shares "
                        "one cache (a single-tenant deployment) (default %(default)s)")
    g.add_argument("--show-prompt-previews", action="store_true",
                   help="show system-prompt text in the cache stats, metrics and dashboard to callers without a key; "
                        "accepted only when --host is a loopback address")
    g.add_argument("--pin", default=None, metavar="FILE",
                   help="pin prefixes at start: JSON lines, each {\"system\": ..., \"tenant\": ..., \"label\": ...} "
                        "(or \"messages\": [...] for a longer prefix); each is prefilled once and kept in the device "
                        "pool within --pin-budget (docs/pins.md)")
    g.add_argument("--priority-range", default=f"{d.priority_range[0]},{d.priority_range[1]}",
                   help="LOW,HIGH: the `priority` values an ordinary caller may send (lower runs first under "
                        "--policy priority); others get a 400 (default %(default)s)")
    g.add_argument("--priority-api-key", action="append", default=[],
                   help="a key (repeatable; env RADIXSERVE_PRIORITY_API_KEYS, comma-separated) whose holders may "
                        "send any priority in [-2**31, 2**31]; accepted wherever --api-key is (an admin key of "
                        "the tenant 'default')")
    g.add_argument("--allowed-origins", default="",
                   help="comma-separated extra browser origins allowed to open the WebSocket and to send "
                        "POST/PUT/PATCH/DELETE (and given CORS headers), '*' for any (default: same origin only)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated extra Host names the server answers (name, or name:port), '*' for any "
                        "(default: 127.0.0.1, localhost, [::1] and the --host address; other Hosts get 421, "
                        "which stops DNS rebinding; binding 0.0.0.0 or :: adds nothing, so list the names "
                        "clients use)")
    g.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: the model's name)")
    g.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest WebSocket frame or HTTP body (default %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: the model's context length)")
    g.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help="chat sessions held at most; the least recently used idle one is evicted "
                        "(default %(default)s)")
    g.add_argument("--max-session-bytes-total", type=int, default=d.max_session_bytes_total,
                   help="memory all sessions may hold together, in bytes (4 per token plus their text); the "
                        "least recently used idle sessions are evicted to stay within it (default %(default)s)")
    g.add_argument("--session-ttl", type=float, default=d.session_ttl_s,
                   help="seconds an idle session lives (default %(default)s)")
    g.add_argument("--owner-share", type=float, default=d.owner_share,
                   help="each session owner's share of --max-sessions and of --max-session-bytes-total: when "
                        "they are full, the owner most over its share loses its least recently used idle session "
                        "first, and an owner over its share cannot evict others' (429) (default %(default)s)")
    g.add_argument("--session-create-rate", type=float, default=d.session_create_rate,
                   help="sessions (creations and forks) one client address may make a second, 0 for no limit; "
                        "beyond it 429 with Retry-After (default %(default)s)")
    g.add_argument("--session-create-burst", type=int, default=d.session_create_burst,
                   help="... and at once (default %(default)s)")
    g.add_argument("--max-generations-per-connection", type=int, default=d.max_generations_per_connection,
                   help="WebSocket generations in flight per connection (default %(default)s)")
    g.add_argument("--ws-send-buffer-bytes", type=int, default=d.ws_send_buffer_bytes,
                   help="bytes of frames that may wait for a slow WebSocket client; beyond that it is "
                        "disconnected (close code 1008) and its generations are aborted (default %(default)s)")
    g.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="reply length for chat sessions that set none (default %(default)s)")
    g.add_argument("--default-temperature", type=float, default=d.default_temperature,
                   help="temperature for chat sessions that set none (default %(default)s)")
    g.add_argument("--default-top-p", type=float, default=d.default_top_p,
                   help="top_p for chat sessions that set none (default %(default)s)")
    g.add_argument("--max-logprob-entries", type=int, default=d.max_logprob_entries,
                   help="OpenAI logprobs one request may ask for: n x max_tokens x (top_logprobs + 1), about 80 "
                        "bytes of JSON each; more is a 400, and an unset max_tokens is clamped to fit "
                        "(default %(default)s)")
    g.add_argument("--system-prompt-labels", type=int, default=d.system_prompt_labels,
                   help="system prompts given their own Prometheus label (default %(default)s)")
    g.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s,
                   help="seconds running generations get to finish on shutdown (default %(default)s)")
    g.add_argument("--web-dir", type=Path, default=DEFAULT_WEB_DIR,
                   help="static web UI directory served at / (default: the repository's web/)")
    g.add_argument("--no-web", action="store_true", help="do not serve the web UI")
    g.add_argument("--health-stall", type=float, default=d.health_stall_s,
                   help="GET /health answers 503 when the engine has run no step for this many seconds while "
                        "requests wait, or its thread died (default %(default)s)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at most (HTTP and WebSocket; lowered to fit the file-descriptor limit); "
                        "beyond it the connection idle longest is closed, or the new one refused with 503 "
                        "(default %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a client has to send a whole request head, from connecting or from the end of "
                        "the previous response; then 408 and close (default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a client has to send a request body after its head (default %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    g.add_argument("--max-concurrent-generations", type=int, default=d.max_concurrent_generations,
                   help="chat requests generating at once, server-wide; beyond it 503 with Retry-After "
                        "(default %(default)s)")
    g.add_argument("--max-generations-per-client", type=int, default=d.max_generations_per_client,
                   help="chat requests generating at once per client address; beyond it 429 with Retry-After "
                        "(default %(default)s)")
    g.add_argument("--max-compiles-per-client", type=int, default=d.max_compiles_per_client,
                   help="structured-output grammars one client address may have compiling at once; beyond it "
                        "429 with Retry-After (default %(default)s)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="how tool calls look in the model's text: hermes (<tool_call>{...}</tool_call>), "
                        "llama3_json (Llama 3.1+ JSON calls), mistral ([TOOL_CALLS]), harmony (gpt-oss's "
                        "commentary-channel messages to functions.NAME), granite (<|tool_call|>[...]), phi4_mini "
                        "(<|tool_call|>[...]<|/tool_call|>), glm4 (<tool_call>NAME and <arg_key>/<arg_value> pairs) "
                        "or pythonic ([f(a=1), g()]) (default: the format the model's chat "
                        "template implies, hermes when it shows none)")
    g.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=REASONING_PARSERS,
                   help="how replies of thinking models split into reasoning (reasoning_content, Responses "
                        "reasoning items, Anthropic thinking blocks) and answer: qwen3 (<think>...</think>, the "
                        "reply may start inside it), deepseek_r1 (the reply starts inside <think>), gpt_oss "
                        "(harmony's analysis and final channels), none (the thinking stays in the text); auto "
                        "tells it from the chat template (default %(default)s)")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object of chat-template variables every chat request renders with, under the "
                        "request's own chat_template_kwargs, e.g. '{\"enable_thinking\": false}' (default: none)")
    g.add_argument("--keep-reasoning-in-history", action="store_true",
                   help="pass the reasoning of earlier assistant turns that clients send back (reasoning_content, "
                        "Responses reasoning items, Anthropic thinking blocks) to the chat template as "
                        "reasoning_content, so templates that render it keep the cached prefix of the previous "
                        "turn; by default it is left out (docs/bench/reasoning.md)")


def _int_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} takes two integers LOW,HIGH, got {text!r}") from None
    return low, high


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SystemExit(f"{flag} takes a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"{flag} takes a JSON object, got {text!r}")
    return value


def server_config_from_args(a: argparse.Namespace) -> ServerConfig:
    import os

    keys_file = a.api_keys or os.environ.get("RADIXSERVE_API_KEYS_FILE") or None
    return ServerConfig(
        host=a.host, port=a.port, api_key=a.api_key or os.environ.get("RADIXSERVE_API_KEY") or None,
        api_keys=load_api_keys(keys_file) if keys_file is not None else [],
        cache_sharing=a.cache_sharing, show_prompt_previews=a.show_prompt_previews,
        pins=load_pin_file(a.pin) if a.pin is not None else [],
        priority_range=_int_pair(a.priority_range, "--priority-range"),
        priority_api_keys=a.priority_api_key + [k for k in os.environ.get("RADIXSERVE_PRIORITY_API_KEYS", "").split(",") if k],
        allowed_origins=[o.strip() for o in a.allowed_origins.split(",") if o.strip()],
        allowed_hosts=[h.strip() for h in a.allowed_hosts.split(",") if h.strip()],
        served_model_name=a.served_model_name, max_message_bytes=a.max_message_bytes,
        max_prompt_tokens=a.max_prompt_tokens, max_sessions=a.max_sessions, session_ttl_s=a.session_ttl,
        max_session_bytes_total=a.max_session_bytes_total, ws_send_buffer_bytes=a.ws_send_buffer_bytes,
        owner_share=a.owner_share, session_create_rate=a.session_create_rate,
        session_create_burst=a.session_create_burst,
        max_generations_per_connection=a.max_generations_per_connection, default_max_tokens=a.default_max_tokens,
        default_temperature=a.default_temperature, default_top_p=a.default_top_p,
        max_logprob_entries=a.max_logprob_entries,
        system_prompt_labels=a.system_prompt_labels, shutdown_grace_s=a.shutdown_grace,
        web_dir=None if a.no_web else a.web_dir, health_stall_s=a.health_stall,
        max_connections=a.max_connections, header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
        keep_alive_timeout_s=a.keep_alive_timeout, max_concurrent_generations=a.max_concurrent_generations,
        max_generations_per_client=a.max_generations_per_client,
        max_compiles_per_client=a.max_compiles_per_client, tool_call_parser=a.tool_call_parser,
        reasoning_parser=a.reasoning_parser,
        chat_template_kwargs=_json_object(a.chat_template_kwargs, "--chat-template-kwargs"),
        keep_reasoning_in_history=a.keep_reasoning_in_history,
    )


def run_server(engine_config: EngineConfig, args: argparse.Namespace) -> int:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.server.runner import serve_forever

    try:
        config = server_config_from_args(args)
    except ValueError as e:
        print(f"radixserve serve: {e}")
        return 2
    return serve_forever(lambda: AsyncEngine(engine_config), config)
