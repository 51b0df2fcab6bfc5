"""A reply's tokens as the history holds them, for templates whose stop token is not their turn's
closing: GLM stops at the next turn's `<|user|>`, gpt-oss at `<|return|>` (history writes `<|end|>`),
ChatML at `<|im_end|>` (its own closing). A session's tokens must equal a fresh render of the same
conversation, so the next turn's prompt hits the cache and the model never sees a doubled marker."""

from __future__ import annotations

import pytest

from radixserve.chat.template import ChatFormatter
from radixserve_bench.chat_tokenizer import train_chat_tokenizer
from radixserve_bench.family_templates import GLM, HARMONY, QWEN2


# gpt-oss writes its reply's channel header itself (the generation prompt ends at `<|start|>assistant`)
@pytest.mark.parametrize("fmt, header, end", [(GLM, "", "<|user|>"),
                                              (HARMONY, "<|channel|>final<|message|>", "<|return|>"),
                                              (QWEN2, "", "<|im_end|>")], ids=["glm", "harmony", "chatml"])
def test_session_tokens_equal_a_fresh_render(fmt, header: str, end: str) -> None:
    tokenizer = train_chat_tokenizer(fmt)
    formatter = ChatFormatter(tokenizer)
    history = [{"role": "user", "content": "Hello"}]
    prompt = formatter.prompt_tokens(history)
    generated = formatter.encode(header + "Hi there") + [tokenizer.convert_tokens_to_ids(end)]
    session = prompt + formatter.closed_reply(history, generated, (generated[-1],))
    history.append({"role": "assistant", "content": "Hi there"})
    turn = formatter.append_user(history, "Next")
    fresh = formatter.prompt_tokens(history + [{"role": "user", "content": "Next"}])
    assert session + turn.user + turn.generation_prompt == fresh
    # the header is template text before the content, which the closing is found without (a fallback)
    assert formatter.incremental_fallbacks == (1 if header else 0)
