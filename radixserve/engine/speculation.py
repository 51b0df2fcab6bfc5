"""Verifying drafts: a verifying draw's k drafts (scheduler/drafts.py chose them; they sit just before
its slot) were computed in one forward with the logits of every position, so its k + 1 rows are
sampled like any other draws and the drafts are checked against what was sampled.

The rule, one for greedy and sampled draws alike: row m (the row of the last token for m = 0, of draft
m otherwise) is sampled exactly as a step without speculation samples that position — the same
filters and the same counter-based random number u(key, position) (engine/sampler.py) — and draft m+1
is kept while it equals the token sampled from row m; the commit is the kept drafts and then the
first sampled token that differs (or the one after the last draft). Greedy, that accepts the longest
prefix equal to the argmax plus the next token. Sampled, it is exact speculative sampling for a
point-mass draft: the draft d is kept with probability p(d) under the request's own filtered
distribution, and otherwise the token drawn is distributed as p with d removed and renormalized. And
since each position's draw reads the same u as without speculation, a seeded request gives the same
tokens with speculation on and off, alone or in any batch.

Layout: the sampler's draws are the launch's draws first, in order (draw i is its own index, the
index every other reader of the sampled ids uses), then every verifying draw's extra rows
(`DraftVerifier.contribute`, the first feature of a step: engine/features.py). A feature that allows
drafts masks those rows too, each at the position it samples, so a verified token is one the
request's rules allow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from radixserve.core import Request, SequenceStatus, TokenLogprob
from radixserve.engine.features import INVALID_LOGITS, LogitsFeature, SamplingStep
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.step_results import Launch, TokenCommit

if TYPE_CHECKING:
    from radixserve.engine.stats import EngineStats

# the most decoding sequences a step drafts for, by device, when --speculative-max-batch is not given:
# above it a step's forward stops being memory-bound, so the drafts' positions cost what they save.
# CPU (2 cores, the embedded model, radixserve bench spec-batch-cap): drafts still gain 1.58x at 32 decoding
# sequences and lose at 64 (0.89x). CUDA: not measured yet; 32 by the same token count per step.
DEFAULT_MAX_BATCH = {"cpu": 32, "cuda": 32}


# the most rows (decodes, prompt chunks, drafts) a drafting step runs while its drafts have not yet shown
# they pay (scheduler/drafts.py), by device, when --speculative-max-rows is not given. CPU (2 cores, the
# embedded model): a step costs 38.6 ms at 1 row, 42.2 at 4 and 81.5 at 16 (`radixserve bench step`), so
# 16 decoding sequences (shared-prefix's rarely kept lookup drafts) draft nothing, while 4 may try 12
# rows: random at 4 clients ran 0.96x / 1.00x / 0.96x speculation off with 16 / 8 / 4 (noise: +-4%),
# and edit-style replies at 4 sequences keep 2.42x of an uncapped 2.46x with 16 (docs/cpu.md).
# CUDA: no knee (not measured yet).
DEFAULT_MAX_ROWS = {"cpu": 16}


def default_max_batch(device: torch.device) -> int:
    return DEFAULT_MAX_BATCH.get(device.type, DEFAULT_MAX_BATCH["cuda"])


def default_max_rows(device: torch.device) -> int | None:
    return DEFAULT_MAX_ROWS.get(device.type)


@dataclass
class VerifyPlan:
    """Where each verifying draw's extra rows are among the sampler's draws."""

    extra_at: dict[int, int] = field(default_factory=dict)  # draw index -> index of its first extra draw


@dataclass
class Verified:
    """What a step's verifications did, for the engine's counters."""

    proposed: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    draws: int = 0


class DraftVerifier(LogitsFeature):
    """Draft verification as a logits feature: it adds each verifying draw's extra rows to the step's
    draws (before any other feature builds masks over them) and, once the ids are on the host,
    replaces each verifying draw's commit by its verified tokens, counting into `totals`. It keeps
    no per-request state: any request may draft unless another feature vetoes it."""

    allows_drafts = True

    def __init__(self, totals: EngineStats) -> None:
        self.totals = totals

    def applies(self, params: SamplingParams) -> bool:
        return False  # nothing per request: it takes part in every step that verifies drafts

    def contribute(self, step: SamplingStep) -> None:
        launch, plan = step.launch, VerifyPlan()
        for i, k in enumerate(launch.drafts):
            if k:
                draw = step.draws[i]
                plan.extra_at[i] = len(step.draws)
                for m in range(1, k + 1):
                    step.add_draw(launch.owners[i], replace(draw, row=draw.row + m, position=draw.position + m))
        if plan.extra_at:
            step.keep(plan)

    def resolve(self, step: SamplingStep) -> None:
        plan = step.part(VerifyPlan)
        if plan is not None:
            step.failed.update((req, INVALID_LOGITS) for req in unusable_verifications(step.launch, plan, step.usable))
            self.totals.count_verified(verify(step.launch, plan, step.ids, step.logprobs, step.commits))


def unusable_verifications(launch: Launch, plan: VerifyPlan, usable: list[bool]) -> list[Request]:
    """The requests a verifying row of which had unusable logits."""
    return [launch.owners[i].request for i, at in plan.extra_at.items()
            if not all(usable[at:at + launch.drafts[i]])]


def verify(launch: Launch, plan: VerifyPlan, ids: list[int], logprobs: dict[int, TokenLogprob],
           commits: list[TokenCommit]) -> Verified:
    """Replace each verifying draw's commit in `commits` by its verified tokens (`ids` and `logprobs`
    are the sampler's, by its draw index); returns the counts."""
    done = Verified()
    for i, at in plan.extra_at.items():
        seq, k, position = launch.owners[i], launch.drafts[i], launch.positions[i]
        if seq.status is SequenceStatus.FINISHED:
            continue  # ended while in flight (an abort): nothing of it commits, nothing is counted
        drafts = seq.token_ids[position - k:position]
        rows = [i] + list(range(at, at + k))
        sampled = [ids[r] for r in rows]
        kept = 0
        while kept < k and sampled[kept] == drafts[kept]:
            kept += 1
        lps = tuple(logprobs[r] for r in rows[:kept + 1]) if i in logprobs else ()
        commits[i] = TokenCommit(tuple(sampled[:kept + 1]), lps, drafts=k)
        source = seq.draft_source
        seq.request.drafts.add(source, k, kept)
        done.proposed[source] += k
        done.accepted[source] += kept
        done.draws += 1
    return done
