"""A stand-in for the model and the sampler, for the scheduler's micro-benchmark and tests: a step
"runs" at once and every draw samples the same token (and keeps the drafts equal to it). Drives the
scheduler exactly as the engine does without overlap (schedule, launched, commit), so what it
measures is the scheduler's own cost.
"""

from __future__ import annotations

from radixserve.core import Batch, Request, Sequence
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.step_results import Committed, TokenCommit


def _no_stop(seq: Sequence, token: int) -> bool:
    return False


def _key(req: Request, index: int) -> int:
    return index


def no_op_step(scheduler: Scheduler, batch: Batch, token: int) -> Committed:
    """Commit `token` for every draw of `batch` (n > 1 forks included); a draw verifying drafts keeps
    those equal to `token` (every row "samples" it), as the engine's verification would; only length
    limits finish."""
    launch = scheduler.launched(batch, (), _key)
    # every draw verifying no draft commits the same (immutable) commit, as before drafts existed:
    # building one per draw would time this stand-in's sampler, not the scheduler
    plain = TokenCommit((token,))
    if not any(launch.drafts):
        return scheduler.commit(launch, [plain] * len(launch.owners), (), _no_stop)
    commits = [_verifying(seq, position, k, token) if k else plain
               for seq, position, k in zip(launch.owners, launch.positions, launch.drafts)]
    return scheduler.commit(launch, commits, (), _no_stop)


def _verifying(seq: Sequence, position: int, k: int, token: int) -> TokenCommit:
    """The commit of a draw verifying `k` drafts: those up to the first that differs from `token`."""
    drafts = seq.token_ids[position - k:position]
    kept = next((i for i, t in enumerate(drafts) if t != token), k)
    return TokenCommit((token,) * (kept + 1), drafts=k)
