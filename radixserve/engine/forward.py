"""A step's forward with fault isolation: one request's input can break a batched forward, so a failed
batch is rerun one item at a time and only the requests whose own forward fails are lost. On a hybrid
model every request of a failed batch fails: the forward may have moved their recurrent states on
part of the way, which a rerun would apply twice.

Writes nothing but logs; the caller tells the scheduler which requests failed.
"""

from __future__ import annotations

import logging

import torch

from radixserve.core import Batch, Request
from radixserve.model.runner import ModelRunner, PendingInputs, RowLogprobs

log = logging.getLogger(__name__)
# what a failed request's caller is told: our words, never a library's exception text (that is logged)
FORWARD_FAILED = "the model failed on this request; see the server log"


def run_isolating_failures(runner: ModelRunner, batch: Batch, inputs: PendingInputs | None,
                           asked: RowLogprobs | None = None) -> tuple[Batch, torch.Tensor | None, dict[Request, str]]:
    """Logits of `batch` (one row per sampling item), queued on the device, and `asked` filled in. If
    the batched forward raises, the batch that actually ran (the items whose own forward succeeded,
    from requests with no failed item), their logits (None if none) and the failed requests, each
    with its caller's message; `asked` then holds NaN in the rows of the items that failed."""
    try:
        return batch, runner.run(batch, inputs, asked), {}
    except Exception:
        if runner.spec.is_hybrid:
            # a recurrent state the failed forward advanced part of the way cannot be run again
            log.exception("a forward pass of %d sequences of a hybrid model failed; they all fail", len(batch.items))
            return Batch([], []), None, {it.seq.request: FORWARD_FAILED for it in batch.items}
        log.exception("a forward pass of %d sequences failed; retrying them one by one", len(batch.items))
    per_item = runner.run_each(batch, inputs, asked)
    failed = {it.seq.request: FORWARD_FAILED for it, rows in zip(batch.items, per_item) if rows is None}
    kept = [(it, rows) for it, rows in zip(batch.items, per_item) if rows is not None and it.seq.request not in failed]
    logits = torch.cat([rows for _, rows in kept]) if kept else None
    return Batch([it for it, _ in kept], []), logits, failed
