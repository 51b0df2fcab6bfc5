"""The chat format of each model family, for the random-weight checkpoints `radixserve bench
random-checkpoint --family` writes: a chat template written after the shape of the family's published
instruct checkpoint (its turn markers, where the system prompt goes, what the generation prompt
opens), and the tokens that template needs.

One constant per format; `FORMAT_OF_FAMILY` names the one each `--family` uses (Gemma 2 and 3, Mistral
and Mixtral, Qwen3 and Qwen3-MoE, GLM and GLM-4 share theirs, as their checkpoints do).

Invariants (tests/bench/test_random_family_serve.py serves each through every API):
- every marker a template writes is a control token of the tokenizer (`ChatFormat.control`), so
  the formatter tokenizes the template's text around contents as single tokens;
- `stop` holds the tokens that end a reply, the template's end of turn first: config.json and
  generation_config.json list exactly these as eos_token_id;
- no template mentions the word the formatter reads as "renders tool definitions itself", so tools
  reach these models as message contents in the hermes format (chat/template.py);
- a template's rendering of a conversation is a text prefix of its rendering with one more message,
  except where the family's own format is not (the harmony header of an assistant reply, GLM's turns
  that end with the next turn's marker), as for the real checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and its tokens. `control` are the special tokens, in the order the tokenizer
    numbers them from 0; `plain` are added tokens that are text (Qwen3's `<think>`), numbered after
    the learned vocabulary."""

    template: str
    control: tuple[str, ...]
    stop: tuple[str, ...]  # the reply ends on any; stop[0] is the template's end of turn
    eos: str  # the tokenizer's eos_token
    pad: str
    bos: str | None = None
    plain: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = [*self.stop, self.eos, self.pad, *([self.bos] if self.bos else [])]
        missing = [t for t in named if t not in self.control]
        if missing:
            raise ValueError(f"tokens {missing} are not among the format's control tokens")
        if len(set(self.control + self.plain)) != len(self.control) + len(self.plain):
            raise ValueError("a token is listed twice")


# Gemma: turns between <start_of_turn>ROLE and <end_of_turn>, the assistant's role is "model", and there
# is no system turn: the system prompt opens the first user turn. Contents are trimmed.
GEMMA = ChatFormat(
    template=(
        "{{- bos_token -}}"
        "{%- if messages and messages[0].role == 'system' -%}"
        "{%- set preamble = messages[0].content + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set preamble = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for m in turns -%}"
        "{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n'"
        " + (preamble if loop.first else '') + (m.content | trim) + '<end_of_turn>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    control=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
    stop=("<end_of_turn>", "<eos>"), eos="<eos>", pad="<pad>", bos="<bos>",
)

# Phi-3: a <|system|>, <|user|> or <|assistant|> marker and a newline open each turn, <|end|> closes it.
PHI3 = ChatFormat(
    template=(
        "{%- for m in messages -%}"
        "{%- if m.role not in ['system', 'user', 'assistant'] -%}"
        "{{- raise_exception('this template has no ' + m.role + ' turns') -}}{%- endif -%}"
        "{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    ),
    control=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
    stop=("<|end|>", "<|endoftext|>"), eos="<|endoftext|>", pad="<|endoftext|>", bos="<s>",
)

# Granite 3: <|start_of_role|>ROLE<|end_of_role|> opens a turn, <|end_of_text|> and a newline close it; a
# conversation without a system prompt gets a default one.
GRANITE = ChatFormat(
    template=(
        "{%- if not (messages and messages[0].role == 'system') -%}"
        "{{- '<|start_of_role|>system<|end_of_role|>You are a helpful assistant built on Granite. "
        "Answer accurately and briefly.<|end_of_text|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}"
    ),
    control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"),
    stop=("<|end_of_text|>",), eos="<|end_of_text|>", pad="<|end_of_text|>", bos="<|end_of_text|>",
)

# GLM-4: the prompt opens with [gMASK]<sop>; a <|ROLE|> marker and a newline open each turn and nothing
# closes one: a reply ends where the model writes the next turn's <|user|> (or <|observation|>, a tool's).
GLM = ChatFormat(
    template=(
        "{%- set markers = {'system': '<|system|>', 'user': '<|user|>', 'assistant': '<|assistant|>',"
        " 'tool': '<|observation|>'} -%}"
        "{{- '[gMASK]<sop>' -}}"
        "{%- for m in messages -%}{{- markers[m.role] + '\\n' + m.content -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    ),
    control=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
             "<|assistant|>", "<|observation|>"),
    stop=("<|user|>", "<|observation|>", "<|endoftext|>"), eos="<|endoftext|>", pad="<|endoftext|>",
)

# OLMo 2: <|ROLE|> and a newline open a turn; the assistant's turn ends with the end-of-text token, the
# others with a newline; the prompt opens with that same token (OLMo 2's bos).
OLMO2 = ChatFormat(
    template=(
        "{{- bos_token -}}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{{- '<|assistant|>\\n' + m.content + eos_token + ('' if loop.last else '\\n') -}}"
        "{%- else -%}{{- '<|' + m.role + '|>\\n' + m.content + '\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    ),
    control=("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"),
    stop=("<|endoftext|>",), eos="<|endoftext|>", pad="<|pad|>", bos="<|endoftext|>",
)


def _chatml(default_system: str | None) -> str:
    """ChatML (<|im_start|>ROLE, newline, content, <|im_end|>, newline), with a default system prompt."""
    opening = ("{%- if not (messages and messages[0].role == 'system') -%}"
               "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' -}}{%- endif -%}"
               if default_system else "")
    return (
        opening
        + "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


_CHATML_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHATML_STOP = ("<|im_end|>", "<|endoftext|>")

# Qwen2 / Qwen2.5: ChatML, with a default system prompt when the conversation has none.
QWEN2 = ChatFormat(template=_chatml("You are a helpful assistant."), control=_CHATML_CONTROL, stop=_CHATML_STOP,
                   eos="<|im_end|>", pad="<|endoftext|>")

# LFM2: ChatML after a <|startoftext|> BOS, with no default system prompt.
LFM2 = ChatFormat(template=_chatml(None), control=("<|startoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"),
                  stop=("<|im_end|>",), eos="<|im_end|>", pad="<|pad|>", bos="<|startoftext|>")

# Nemotron-H's base checkpoints carry no chat template: ChatML, with its tokens as the control tokens.
NEMOTRON_H = ChatFormat(template=_chatml(None), control=_CHATML_CONTROL, stop=("<|im_end|>", "<|endoftext|>"),
                        eos="<|im_end|>", pad="<|endoftext|>")

# OLMo 3 Instruct: ChatML, with a default system prompt that names the model.
OLMO3 = ChatFormat(template=_chatml("You are Olmo, a helpful assistant."),
                   control=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"), stop=_CHATML_STOP,
                   eos="<|im_end|>", pad="<|pad|>", bos="<|endoftext|>")

# Qwen3 (and Qwen3-MoE): ChatML; a reply may think first inside <think>...</think> (added tokens that are
# text). An assistant turn after the last user message shows the reasoning a client sent back, earlier ones
# drop it; `enable_thinking: false` makes the generation prompt hold an empty thought.
QWEN3 = ChatFormat(
    template=(
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- set thought = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if thought and loop.index0 > ns.last_user -%}{{- '<think>\\n' + (thought | trim) + '\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{{- m.content + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
        "{%- endif -%}"
    ),
    control=_CHATML_CONTROL, stop=_CHATML_STOP, eos="<|im_end|>", pad="<|endoftext|>", plain=("<think>", "</think>"),
)

# SmolLM3: ChatML whose system turn always comes first, with a metadata header naming the reasoning mode
# (/think, or /no_think when `enable_thinking` is false) and the system prompt as custom instructions;
# earlier replies are shown without their reasoning; without thinking the generation prompt holds an empty
# thought.
SMOLLM3 = ChatFormat(
    template=(
        "{%- set thinking = not (enable_thinking is defined and not enable_thinking) -%}"
        "{{- '<|im_start|>system\\n## Metadata\\n\\nReasoning Mode: ' + ('/think' if thinking else '/no_think')"
        " + '\\n\\n## Custom Instructions\\n\\n' -}}"
        "{%- if messages and messages[0].role == 'system' -%}"
        "{{- messages[0].content + '\\n\\n' -}}{%- set turns = messages[1:] -%}"
        "{%- else -%}{{- 'You are a helpful assistant.\\n\\n' -}}{%- set turns = messages -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- for m in turns -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if not thinking -%}{{- '<think>\\n\\n</think>\\n' -}}{%- endif -%}{%- endif -%}"
    ),
    control=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|im_start|>", "<|im_end|>"),
    stop=("<|im_end|>", "<|end_of_text|>"), eos="<|im_end|>", pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>", plain=("<think>", "</think>"),
)

# Llama 3: <|start_header_id|>ROLE<|end_header_id|>, a blank line, the trimmed content, <|eot_id|>; tool
# results are the ipython role's.
LLAMA3 = ChatFormat(
    template=(
        "{{- bos_token -}}"
        "{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n'"
        " + (m.content | trim) + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
    ),
    control=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
             "<|eom_id|>", "<|finetune_right_pad_id|>"),
    stop=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"), eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
)

# Mistral and Mixtral: [INST] user [/INST] reply</s>, after <s>; the system prompt opens the first user
# message; there is no generation prompt (the model answers right after [/INST]).
MISTRAL = ChatFormat(
    template=(
        "{{- bos_token -}}"
        "{%- if messages and messages[0].role == 'system' -%}"
        "{%- set preamble = messages[0].content + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set preamble = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for m in turns -%}"
        "{%- if m.role == 'assistant' -%}{{- m.content + eos_token -}}"
        "{%- else -%}{{- '[INST] ' + (preamble if loop.first else '') + m.content + ' [/INST]' -}}{%- endif -%}"
        "{%- endfor -%}"
    ),
    control=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
    stop=("</s>",), eos="</s>", pad="<unk>", bos="<s>",
)

# gpt-oss (harmony): a system message naming the reasoning effort and the channels, the system prompt as
# the developer's instructions, then messages <|start|>ROLE<|message|>...<|end|>; replies are assistant
# messages in the final channel (their reasoning, when sent back after the last user message, in the
# analysis channel); the generation prompt opens an assistant message whose header the model writes.
HARMONY = ChatFormat(
    template=(
        "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: '"
        " + (reasoning_effort if reasoning_effort is defined else 'medium')"
        " + '\\n\\n# Valid channels: analysis, commentary, final.<|end|>' -}}"
        "{%- if messages and messages[0].role == 'system' -%}"
        "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' -}}"
        "{%- set turns = messages[1:] -%}{%- else -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in turns -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in turns -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- if m.reasoning_content is defined and m.reasoning_content and loop.index0 > ns.last_user -%}"
        "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}{%- endif -%}"
        "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
        "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
    ),
    control=("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
             "<|call|>"),
    stop=("<|return|>", "<|call|>", "<|endoftext|>"), eos="<|return|>", pad="<|endoftext|>",
)

FORMAT_OF_FAMILY: dict[str, ChatFormat] = {
    "llama": LLAMA3, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3-moe": QWEN3, "qwen3.5": QWEN3, "qwen3.5-moe": QWEN3,
    "qwen3-next": QWEN3, "lfm2": LFM2, "lfm2-moe": LFM2, "nemotron-h": NEMOTRON_H, "nemotron-3": NEMOTRON_H,
    "granite-4": GRANITE, "granite-4-moe": GRANITE, "falcon-h1": NEMOTRON_H,
    "mistral": MISTRAL, "mixtral": MISTRAL,
    "gemma2": GEMMA, "gemma3": GEMMA, "gemma-4": GEMMA, "gpt-oss": HARMONY, "phi3": PHI3, "olmo2": OLMO2, "olmo3": OLMO3,
    "smollm3": SMOLLM3, "glm4": GLM, "glm": GLM, "granite": GRANITE,
}
