"""What callers see of each sequence: its incremental text, the tokens and logprobs not yet handed
out, and the RequestOutput built from them.

Owns one detokenizer and one "sent" mark per live sequence. A streamed output carries exactly the
resolved tokens (and their logprobs, when asked) generated since the previous output of the same
sequence; a pending token (still on the device) is never handed out. Each output that hands out new
tokens stamps the request's Timing (`add_token_time`), so its inter-token latency figures (mean, max)
are the gaps between those hand-outs: the ITL a streaming caller of the engine sees. A sequence that
finished with "stop" carries its `stop_reason`: the stop string its detokenizer matched, else the
stop_token_ids id it ended on (the engine's stop test sees the same tokens in the same order).
"""

from __future__ import annotations

import time
from typing import Any

from radixserve.core import CompletionOutput, Request, RequestOutput, Sequence, SequenceStatus, Usage
from radixserve.engine.detokenizer import IncrementalDetokenizer


class OutputTracker:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._sent: dict[int, int] = {}  # seq_id -> generated tokens already handed out
        self._stop_ids: dict[int, int] = {}  # seq_id -> the stop_token_ids id it committed (it ends there)

    def track(self, seq: Sequence) -> None:
        params = seq.request.params
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                                         self.eos_token_ids)
        self._sent[seq.seq_id] = 0

    def add_token(self, seq: Sequence, token: int) -> bool:
        """Detokenize a newly resolved token; True when a stop string has appeared."""
        detok = self._detok[seq.seq_id]
        params = seq.request.params
        detok.add([token], check_stops=len(detok.ids) + 1 >= params.min_tokens)  # min_tokens holds stop strings too
        # EOS goes first, as in vLLM: a stop id that is also the model's EOS reports no stop_reason
        if token in params.stop_token_ids and (params.ignore_eos or token not in self.eos_token_ids):
            self._stop_ids.setdefault(seq.seq_id, token)
        return detok.stopped

    def _stop_reason(self, seq: Sequence) -> str | int | None:
        if seq.finish_reason != "stop":
            return None
        match = self._detok[seq.seq_id].stop_match
        return match if match is not None else self._stop_ids.get(seq.seq_id)

    def output(self, req: Request, seqs: list[Sequence]) -> RequestOutput:
        """The request's output for `seqs` since their last one; the last of a request retires it."""
        outs = []
        now = time.monotonic()
        for seq in dict.fromkeys(seqs):
            sent = self._sent[seq.seq_id]
            final = seq.status is SequenceStatus.FINISHED
            lps = seq.logprobs[sent:seq.num_generated] if req.params.logprobs is not None else None
            outs.append(CompletionOutput(seq.index, seq.generated_ids[sent:], self._detok[seq.seq_id].delta(final),
                                         seq.finish_reason, lps, self._stop_reason(seq)))
            self._sent[seq.seq_id] = seq.num_generated
        if any(o.token_ids for o in outs):
            req.timing.add_token_time(now)
        if req.finished:
            req.timing.finished = now
            for seq in req.sequences:
                self._detok.pop(seq.seq_id, None)
                self._sent.pop(seq.seq_id, None)
                self._stop_ids.pop(seq.seq_id, None)
        drafts = req.drafts.snapshot() if req.drafts.proposed or req.drafts.prediction_tokens else None
        usage = Usage(len(req.prompt_token_ids), req.cached_tokens, sum(s.num_generated for s in req.sequences),
                      req.host_cached_tokens, drafts)
        return RequestOutput(req.request_id, outs, usage, req.timing, req.finished, req.prompt_token_ids)
