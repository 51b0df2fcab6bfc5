"""A small byte-level BPE tokenizer trained on the spot for a chat format (family_templates.py), saved
the way transformers saves a real one (tokenizer.json, tokenizer_config.json, chat_template.jinja).

Invariants: the format's control tokens take ids 0, 1, ... in the order the format lists them and are
special (skipped when replies are decoded); its plain added tokens come after the learned vocabulary;
every byte has a token, so any text round-trips; the vocabulary is `len(tokenizer)`, at most
`MAX_VOCAB`, which the checkpoint's embedding must cover.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve_bench.family_templates import ChatFormat

MAX_VOCAB = 512
# what the merges are learned from: chat, the JSON of structured output and tool calls, code
_CORPUS = (
    "Hello! How are you today? I am fine, thank you. What is the weather like in Paris?",
    "It is sunny and warm in Paris today, with a light wind from the west.",
    "You are a helpful assistant. Answer the question in one short sentence.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "score": 1.5}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "<think>\nThe user asks a question; I should answer briefly.\n</think>\n\nHere is the answer.",
)


def train_chat_tokenizer(fmt: ChatFormat, vocab: int = MAX_VOCAB) -> Any:
    """A transformers PreTrainedTokenizerFast for `fmt`, at most `vocab` tokens, with its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(fmt.plain), special_tokens=list(fmt.control),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fmt.plain])
    specials = {"eos_token": fmt.eos, "pad_token": fmt.pad, **({"bos_token": fmt.bos} if fmt.bos else {})}
    named = set(specials.values())
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=fmt.template,
                                   extra_special_tokens=[t for t in fmt.control if t not in named], **specials)
    for i, token in enumerate(fmt.control):
        if fast.convert_tokens_to_ids(token) != i:
            raise AssertionError(f"control token {token!r} did not get id {i}")
    return fast


def write_chat_tokenizer(fmt: ChatFormat, out: Path) -> Any:
    """Train the tokenizer of `fmt` and save it into `out`; returns it."""
    tokenizer = train_chat_tokenizer(fmt)
    tokenizer.save_pretrained(out)
    return tokenizer
