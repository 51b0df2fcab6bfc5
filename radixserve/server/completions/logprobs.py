"""The logprob bodies /v1/completions adds to the chat endpoint's: OpenAI's legacy `logprobs` object,
and vLLM's `prompt_logprobs` list (on /v1/completions choices and on chat completions, top level).

Legacy shape, one per choice (streamed: one per chunk, holding that chunk's tokens):
{"tokens": [text], "token_logprobs": [logprob | null], "top_logprobs": [{text: logprob} | null],
"text_offset": [int]}, the four lists of equal length.
- `tokens[i]` is the token decoded on its own, special tokens included (TokenTexts, as the chat
  logprobs show it), so an end-of-sequence token is listed although the text never holds it.
- `text_offset[i]` is the summed length of the tokens before it in the choice (the echoed prompt's
  included): a choice's offsets continue across its chunks, so the streamed lists concatenate to the
  non-streamed ones. Where the text is the tokens' texts joined (no BOS, no token splitting a UTF-8
  character) `text[text_offset[i]:][:len(tokens[i])] == tokens[i]`.
- `top_logprobs[i]` maps the k most likely tokens (k = `logprobs`) and token i itself to their
  logprobs, as OpenAI and vLLM answer: up to k + 1 entries, so `logprobs: 0` gives the token alone
  and token i's text is always a key. Two that decode to the same text (partial UTF-8 characters:
  "\ufffd") keep the more likely one, a dict holds one.
- An echoed prompt's first token has `null` logprob and `null` top_logprobs: nothing precedes it.

vLLM's prompt_logprobs: one item per prompt token, `null` for the first, then `{"<token id>":
{"logprob", "rank", "decoded_token"}}` holding the prompt token and its k alternatives. Alternatives
rank 1..k, most likely first; the prompt token has its alternative's rank when it is among them, else
k + 1 (its true rank is at least that; the engine keeps only the top k).

Values pass through json_logprob (-inf and anything below LOGPROB_FLOOR sent as the floor), as the
chat bodies do. A request's entries are bounded by logprobs.cap_logprob_entries, its `spent` the
prompt's (logprobs.entries(prompt tokens, k) per list a response carries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.core import TokenLogprob
from radixserve.sampling_params import MAX_LOGPROBS
from radixserve.server.pipeline.logprobs import TokenTexts, json_logprob
from radixserve.server.validation import ApiError, get_int

Entry = tuple[int, TokenLogprob | None]  # a token id and its logprob record (None: a prompt's first token)


def prompt_logprobs_field(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` (0..20): None when not asked. Like vLLM, not with `stream: true`
    (a stream has no place for them)."""
    top = get_int(body, "prompt_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and stream:
        raise ApiError("invalid_field", "'prompt_logprobs' is not available when 'stream' is true",
                       param="prompt_logprobs")
    return top


def prompt_items(tokens: Sequence[int], lps: Sequence[TokenLogprob | None] | None) -> list[Entry]:
    """A prompt's tokens with their engine entries; all None when the engine gave none."""
    return list(zip(tokens, lps if lps is not None else [None] * len(tokens)))


def generated_items(lps: Sequence[TokenLogprob] | None) -> list[Entry]:
    return [(lp.token_id, lp) for lp in lps or ()]


@dataclass
class LegacyLogprobs:
    """One choice's legacy logprobs, built a chunk at a time: `offset` is the text_offset its next
    token gets."""

    texts: TokenTexts
    top: int
    offset: int = 0

    def body(self, items: Sequence[Entry]) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in items:
            text = self.texts(token_id)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            values.append(None if lp is None else json_logprob(lp.logprob))
            tops.append(None if lp is None else self._alternatives(lp, text))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _alternatives(self, lp: TokenLogprob, text: str) -> dict[str, float]:
        """The top k, then the token itself (`text`) when none of them shares its text."""
        out: dict[str, float] = {}
        for token_id, value in lp.top[:self.top]:  # most likely first: setdefault keeps the likelier of a clash
            out.setdefault(self.texts(token_id)[0], json_logprob(value))
        out.setdefault(text, json_logprob(lp.logprob))
        return out


def prompt_logprobs_body(tokens: Sequence[int], lps: Sequence[TokenLogprob | None] | None, top: int,
                         texts: TokenTexts) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` list for a prompt (the engine's entries may hold more alternatives than
    `top`: a request whose echoed legacy logprobs ask more)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in prompt_items(tokens, lps):
        if lp is None:
            out.append(None)
            continue
        alternatives = lp.top[:top]
        rank = next((r for r, (tid, _) in enumerate(alternatives, 1) if tid == token_id), top + 1)
        item = {str(token_id): {"logprob": json_logprob(lp.logprob), "rank": rank, "decoded_token": texts(token_id)[0]}}
        for r, (tid, value) in enumerate(alternatives, 1):
            item.setdefault(str(tid), {"logprob": json_logprob(value), "rank": r, "decoded_token": texts(tid)[0]})
        out.append(item)
    return out
