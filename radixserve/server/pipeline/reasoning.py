"""Reasoning and template variables as every chat-shaped API asks for them (chat completions, Responses,
Anthropic Messages, sessions), and how the pipeline reads a reply of a thinking model.

Template variables of a request, later ones winning: the operator's `--chat-template-kwargs`, then what
the API's own fields mean to templates (`variables_for_effort`: chat's `reasoning_effort`, Responses'
`reasoning.effort`; Anthropic's `thinking`), then the request's `chat_template_kwargs` (vLLM's and
SGLang's field: a JSON object, else a 400 naming it). Templates read `enable_thinking` (Qwen3) and
`reasoning_effort` (gpt-oss); an effort of "none" also sets `enable_thinking` false. The merged
variables are checked once by the formatter (`ChatFormatter.check_variables`: no control-token string,
nothing the server passes itself), a 400 naming the key otherwise.

Earlier reasoning in a conversation a client sends back (chat's `reasoning_content` on an assistant
message, a Responses `reasoning` item, an Anthropic `thinking` block) reaches the template as that
message's `reasoning_content` under `--keep-reasoning-in-history`, and is left out otherwise
(`history_reasoning`).

Reading: the served model's reasoning format is `--reasoning-parser`'s, "auto" its template's
(`reasoning_of`). Invariant: a planned prompt knows whether it leaves the reply inside the reasoning
(`Planned.opened`, from the prompt's last tokens), so every API reads the same reply alike
(`Plan.reader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from radixserve.chat.reasoning import ReasoningFormat
from radixserve.server.validation import ApiError

if TYPE_CHECKING:
    from radixserve.server.state import ServerState

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning efforts


def reasoning_of(state: ServerState) -> ReasoningFormat | None:
    """The served model's reasoning format (None: replies are read as text)."""
    formatter, _ = state.require_chat()
    return formatter.reasoning_for(state.config.reasoning_parser)


def template_variables(state: ServerState, requested: Any, mapped: Mapping[str, Any] | None = None,
                       param: str = "chat_template_kwargs", base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The variables a request renders its template with (see the module docstring); `requested` is its
    `chat_template_kwargs` (None: absent); `base` what they go over (a session's turn: the session's,
    which hold the operator's already), else the operator's."""
    if requested is not None and not isinstance(requested, dict):
        raise ApiError("invalid_field", f"'{param}' must be a JSON object of template variables", param=param)
    merged = {**(state.config.chat_template_kwargs if base is None else base), **(mapped or {}), **(requested or {})}
    if not merged:
        return {}
    formatter, _ = state.require_chat()
    try:
        return formatter.check_variables(merged, param)
    except ValueError as e:
        raise ApiError("invalid_field", str(e), param=param) from None


def variables_for_effort(effort: Any, param: str) -> dict[str, Any]:
    """A reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`) as template variables."""
    if effort is None:
        return {}
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise ApiError("invalid_field", f"'{param}' must be one of {', '.join(EFFORTS)}, got {effort!r}", param=param)
    if effort == "none":
        return {"reasoning_effort": effort, "enable_thinking": False}
    return {"reasoning_effort": effort}


def history_reasoning(state: ServerState, message: dict[str, Any], reasoning: Any, param: str) -> dict[str, Any]:
    """An assistant history message with the reasoning the client sent back for it: as its
    `reasoning_content` under --keep-reasoning-in-history (a string, else a 400 naming `param`), left out
    otherwise."""
    if reasoning is None or not state.config.keep_reasoning_in_history:
        return message
    if not isinstance(reasoning, str):
        raise ApiError("invalid_field", f"'{param}' must be a string", param=param)
    return {**message, "reasoning_content": reasoning} if reasoning else message
