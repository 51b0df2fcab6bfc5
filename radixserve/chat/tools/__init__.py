"""Tool calling in the engine layer: the OpenAI tool values, each model family's tool-call format (parser,
streaming parser, constraint grammars, prompt preamble), and which format a model speaks.

The server builds the OpenAI `tools`/`tool_choice` API on these; chat templates render tools with them
(chat/template.py). Nothing here imports the server.
"""

from radixserve.chat.tools.base import ToolCallFormat, ToolStream, arguments_object
from radixserve.chat.tools.registry import FORMATS, tool_format
from radixserve.chat.tools.types import (
    ContentDelta,
    ParsedReply,
    ReplyDelta,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    new_call_id,
)

__all__ = [
    "FORMATS",
    "ContentDelta",
    "ParsedReply",
    "ReplyDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolChoice",
    "ToolSpec",
    "ToolStream",
    "arguments_object",
    "new_call_id",
    "tool_format",
]
