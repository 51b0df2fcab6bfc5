"""The tool-call formats by name, and which one a model speaks, told from its chat template.

Invariants: a flag value (`--tool-call-parser`) always wins and an unknown one is an error naming the
choices; without one, the template's own tool-call markup decides (harmony's channel markers: gpt-oss;
GLM's <arg_key>; Granite's <|tool_call|> in <|start_of_role|> turns; Phi-4-mini's <|tool|> list; Gemma
4's <|tool_call>), and a
template with none (the embedded SmolLM2's) gets hermes, which `ToolCallFormat.system_prompt` then
teaches the model. `pythonic` is never told from a template (none announces Python-call replies
reliably): only the flag names it. Every format closes the objects of tool parameters unless asked for
open ones (`open_objects`, --open-json-objects).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from radixserve.chat.tools.base import ToolCallFormat
from radixserve.chat.tools.gemma4 import OPEN as GEMMA4_CALL
from radixserve.chat.tools.gemma4 import Gemma4Format
from radixserve.chat.tools.glm4 import KEY, Glm4Format
from radixserve.chat.tools.granite import PHI4_MINI, PHI_CLOSE, TOOL_CALL, GraniteFormat
from radixserve.chat.tools.harmony import CHANNEL, MESSAGE, HarmonyFormat
from radixserve.chat.tools.hermes import HermesFormat
from radixserve.chat.tools.llama3 import Llama3JsonFormat
from radixserve.chat.tools.mistral import MistralFormat
from radixserve.chat.tools.pythonic import PythonicFormat

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(),
                                                          HarmonyFormat(), GraniteFormat(), PHI4_MINI, Glm4Format(),
                                                          PythonicFormat(), Gemma4Format())}

# Llama 3.1's template hands results back in "ipython" turns and asks for {"name": ..., "parameters": ...}
_LLAMA3_JSON = re.compile(r"ipython|\"parameters\"|'parameters'|<\|python_tag\|>")


def tool_format(chat_template: str | None, override: str | None = None, tokenizer: Any = None,
                open_objects: bool = False) -> ToolCallFormat:
    """The format for a model: `override` if given, else told from `chat_template`. With `tokenizer`, the
    format knows which of its markers are single tokens (see ToolCallFormat.for_tokenizer)."""
    if override:
        if override not in FORMATS:
            raise ValueError(f"unknown tool-call parser {override!r}; choose one of {', '.join(sorted(FORMATS))}")
        fmt = FORMATS[override]
        if isinstance(fmt, MistralFormat) and chat_template and "[ARGS]" in chat_template:
            fmt = MistralFormat(args_syntax=True)
    else:
        fmt = _from_template(chat_template or "")
    if open_objects:
        fmt = dataclasses.replace(fmt, open_objects=True)
    return fmt.for_tokenizer(tokenizer) if tokenizer is not None else fmt


def _from_template(template: str) -> ToolCallFormat:
    if CHANNEL in template and MESSAGE in template:  # gpt-oss's harmony: its tools are TypeScript, its calls messages
        return FORMATS["harmony"]
    if GEMMA4_CALL in template:  # Gemma 4's <|tool_call>call:NAME{...}<tool_call|>
        return FORMATS["gemma4"]
    if "[TOOL_CALLS]" in template:
        return MistralFormat(args_syntax="[ARGS]" in template)
    if KEY in template:  # GLM-4.5's calls are <tool_call> blocks too, of key/value tags
        return FORMATS["glm4"]
    if TOOL_CALL in template and "<|start_of_role|>" in template:
        return FORMATS["granite"]
    # Phi-4-mini's template lists the tools in <|tool|> tags; a template that writes calls closes them
    if "<|tool|>" in template or (TOOL_CALL in template and PHI_CLOSE in template):
        return FORMATS["phi4_mini"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or ("tools" in template and _LLAMA3_JSON.search(template)):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
