"""The token ids a pin holds: exactly what every chat that begins with given messages (a system
prompt, or a longer run of turns) starts with, under the server's chat template.

A template may render a turn differently depending on what follows it (a date in a header, a
merged turn, a newline that belongs to the next header), so the prefix is not "the messages rendered
alone": it is the longest common token prefix of the renderings of the messages followed by two
different user messages, and, when the messages end with a user turn, of the messages asking for a
reply (a chat that sends exactly them). Whatever a chat appends, it starts with those tokens; the user
header after a system turn is part of the prefix when every continuation has it. Tools render into
the prefix as the request offering them renders them (cache_control.py).

Invariants: the prefix is never empty (a ValueError instead); rendering goes through the server's
PromptWorker, so a long prompt is tokenized off the event loop, with the same tokens a chat gets.
"""

from __future__ import annotations

import os

from jinja2.exceptions import TemplateError

from radixserve.chat.template import Message
from radixserve.chat.tools import ToolSpec
from radixserve.server.pipeline.prompt_worker import PromptWorker

_PROBES = ("a", "b")  # two user messages with different first tokens


async def chat_prefix(prompts: PromptWorker, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
    """The tokens every chat beginning with `messages` (offering `tools`) starts with; ValueError when
    there are none, or the template refuses the messages."""
    chats = [[*messages, {"role": "user", "content": probe}] for probe in _PROBES]
    if messages[-1]["role"] == "user":
        chats.append(messages)
    renderings = []
    for chat in chats:
        try:
            prompt, _ = await prompts.chat_tokens(chat, tools)
        except TemplateError as e:  # the template's own refusal (roles that must alternate, ...)
            raise ValueError(f"the chat template refuses these messages: {e}") from None
        renderings.append(prompt)
    n = len(os.path.commonprefix(renderings))  # on lists of ints it compares element-wise
    if n == 0:
        raise ValueError("the chat template renders these messages into no common prefix")
    return renderings[0][:n]
