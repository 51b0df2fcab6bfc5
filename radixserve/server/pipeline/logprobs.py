"""OpenAI `logprobs` bodies: each generated token's logprob, text and bytes, with its alternatives.

The engine hands out TokenLogprob records (ids and raw-distribution logprobs, see SamplingParams);
this module turns them into the OpenAI shape {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.

- `token` is the token id decoded on its own, special tokens included ("<|im_end|>") and no
  clean-up of spaces: the text that token contributes. A token that holds only part of a UTF-8
  character decodes to "\ufffd"; its `bytes` are still exact where the tokenizer is byte-level BPE
  (GPT-2 style: the token's own bytes, so concatenating a run of tokens' bytes rebuilds the
  character); otherwise `bytes` is the UTF-8 of `token`. Without a tokenizer a token is shown as
  "token_id:<id>" (vLLM's form), as is an id the tokenizer cannot decode.
- `logprob` values below LOGPROB_FLOOR, -inf included (a token the model rules out), and any
  non-finite value are reported as LOGPROB_FLOOR: JSON has no infinities (as vLLM does).
- `top_logprobs` lists the k alternatives the request asked for, most likely first.

A body holds n × completion tokens × (top_logprobs + 1) entries of about 80 bytes of JSON each, so a
request's logprobs are bounded before it runs (`cap_logprob_entries`, --max-logprob-entries): one
small request must not make the server build hundreds of megabytes; prompt logprobs (vLLM's
`prompt_logprobs`, an echoed prompt's: server/completions/logprobs.py) count too, prompt tokens × (k + 1)
per list the body carries. Bodies over OFFLOAD_ENTRIES are built off the event loop by the caller
(`entries` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixserve.core import TokenLogprob
from radixserve.server.validation import ApiError

LOGPROB_FLOOR = -9999.0  # stands for -inf and anything below it
# Entries past which a body is built in a worker thread: about 5 ms of Python on the event loop below it
OFFLOAD_ENTRIES = 1024


def entries(tokens: int, top: int | None) -> int:
    """The logprob entries of `tokens` generated tokens with `top` alternatives each (None: not asked)."""
    return 0 if top is None else tokens * (top + 1)


def cap_logprob_entries(n: int, max_tokens: int | None, top: int | None, cap: int, *, spent: int = 0,
                        param: str = "top_logprobs", prompt_param: str = "prompt_logprobs") -> int | None:
    """Bound a request's logprob entries, `spent` + n × max_tokens × (top + 1), by `cap`. `spent`: the
    entries of its prompt logprobs, which do not depend on max_tokens (over the cap alone: a 400 naming
    `prompt_param`); `top` None: no generated-token logprobs, only `spent` counts; `param`: the field
    `top` came from. An explicit max_tokens over it is a 400 naming the product and the cap. An unset
    one would default to the context left, which may be far more than the cap allows, so the largest
    max_tokens that fits is returned for the caller to clamp that default to (an ordinary request
    without max_tokens still runs, its length bounded); None when max_tokens was given."""
    limit = f"this server's limit of {cap} (--max-logprob-entries)"
    if spent > cap:
        raise ApiError("too_many_logprobs", f"the prompt's logprobs take {spent} entries, over {limit}; ask fewer "
                       "alternatives or send a shorter prompt", param=prompt_param)
    if top is None:
        return None
    per_token = entries(n, top)
    if max_tokens is None and per_token <= cap - spent:
        return (cap - spent) // per_token
    shown = "1" if max_tokens is None else str(max_tokens)
    total = spent + per_token * (max_tokens or 1)
    if total <= cap:
        return None
    prompt = (f"{spent} prompt logprob entries + ", f"{spent} + ") if spent else ("", "")
    raise ApiError("too_many_logprobs", f"{prompt[0]}n × max_tokens × ({param} + 1) = {prompt[1]}{n} × {shown} × "
                   f"({top} + 1) = {total} logprob entries exceeds {limit}; lower n, max_tokens or {param}",
                   param=param)


def json_logprob(x: float) -> float:
    """A logprob as JSON can carry it: finite, at least LOGPROB_FLOOR."""
    return max(float(x), LOGPROB_FLOOR) if math.isfinite(x) else LOGPROB_FLOOR


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()


class TokenTexts:
    """The (text, bytes) of single token ids for one tokenizer, computed once per id (a vocabulary's
    worth at most)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = set(added) if isinstance(added, dict) else set()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text, raw = f"token_id:{token_id}", None
        tok = self.tokenizer
        try:
            piece = tok.convert_ids_to_tokens(token_id) if tok is not None else None
            if isinstance(piece, str):  # None: no tokenizer, or an id outside its vocabulary
                text = str(tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))
                if self._byte_level and token_id not in self._added and all(c in _BYTE_LEVEL for c in piece):
                    raw = bytes(_BYTE_LEVEL[c] for c in piece)
        except Exception:  # an id the tokenizer cannot decode
            text, raw = f"token_id:{token_id}", None
        return text, list(raw if raw is not None else text.encode("utf-8", "replace"))


def logprobs_body(lps: Sequence[TokenLogprob] | None, texts: TokenTexts) -> dict[str, Any]:
    """One choice's `logprobs` object for these tokens."""
    content = []
    for lp in lps or ():
        token, raw = texts(lp.token_id)
        alternatives = []
        for tid, value in lp.top:  # exactly the alternatives the request asked for (the engine trims)
            alt, alt_raw = texts(tid)
            alternatives.append({"token": alt, "logprob": json_logprob(value), "bytes": alt_raw})
        content.append({"token": token, "logprob": json_logprob(lp.logprob), "bytes": raw,
                        "top_logprobs": alternatives})
    return {"content": content}
