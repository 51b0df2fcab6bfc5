"""Hybrid models (Gated DeltaNet layers beside attention) through the engine, against transformers'
greedy `generate` (fp32, token for token): cold, multi-turn hits resuming at a reply's end (mid-block),
branch points checkpointed and then hit, exact re-sends, forks, preemption, the host tier (a node
that left the device lost its checkpoint: recomputed, never a wrong state), too few state slots, the
cache off, overlap, seeded sampling inside a mixed batch, beam search, and a forward that fails after
moving states on (its whole batch fails; no checkpoint keeps a half-moved state)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from test_beam_search import assert_equal_to_reference
from test_engine import assert_clean, random_prompts, reference, take_turns
from test_families import check as check_family
from test_families import check_seeded_in_a_mixed_batch
from test_families import make as make_family
from tiny_models import HYBRID_CONFIGS, hf_model, tiny_model_dir

from radixserve import LLM, BeamSearchParams, SamplingParams
from radixserve.cache.window_blocks import least_window_blocks
from radixserve.core import Batch
from radixserve.kernels.cpu_extension import loaded_or_explained
from radixserve.model.delta_net import GatedDeltaNet

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# the sliding-window families whose window layers keep their K/V as a state (--sliding-window-kv window)
WINDOW_STATE_ARCHS = ["gemma2", "gemma3", "gpt_oss", "olmo3"]
ARCHS = sorted(HYBRID_CONFIGS) + WINDOW_STATE_ARCHS


def make(arch: str, **kw: object) -> LLM:
    return make_family(arch, **{"sliding_window_kv": "window", **kw})


def check(arch: str, llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return check_family(arch, llm, prompts, params)


# the C++ delta rule without overlap; the torch recurrence (every step eager) with it
@pytest.mark.parametrize("overlap, eager", [(False, False), (True, True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_matches_transformers_at_every_kind_of_hit(arch: str, overlap: bool, eager: bool) -> None:
    llm = make(arch, overlap=overlap, enforce_eager=eager, num_speculative_tokens=4)
    kernels = {m.implementation for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)}
    cpp = not eager and loaded_or_explained() is not None
    assert kernels == ({"cpp" if cpp else "torch"} if llm.engine.model.spec.delta_nets else set())
    base = random_prompts([22], seed=3)[0]
    first = check(arch, llm, [base])[0]
    assert first.usage.cached_tokens == 0
    # multi-turn: the next prompt extends the reply; the state checkpointed at the reply's end resumes it
    turn2 = base + first.outputs[0].token_ids + random_prompts([5], seed=4)[0]
    second = check(arch, llm, [turn2])[0]
    reply_end = len(base) + NEW - 1  # the last sampled token was never consumed
    assert second.usage.cached_tokens == reply_end and reply_end % 4  # mid-block
    just_past = turn2[:reply_end + 1] + random_prompts([3], seed=5)[0]  # a hit ending exactly at the checkpoint
    assert check(arch, llm, [just_past])[0].usage.cached_tokens == reply_end
    # a branch point: the first prompt to leave a cached path there stops its prefill to checkpoint it
    recomputed = llm.engine.stats().state_recomputed_tokens
    branch = base[:13] + random_prompts([6], seed=6)[0]
    assert check(arch, llm, [branch])[0].usage.cached_tokens == 0
    stats = llm.engine.stats()
    assert stats.state_recomputed_tokens == recomputed + 13  # the cache says what it could not restore
    assert stats.state_checkpoints == stats.state_checkpoints_taken > 0 and stats.state_slots_total > 0
    again = base[:13] + random_prompts([4], seed=7)[0]
    assert check(arch, llm, [again])[0].usage.cached_tokens == 13
    # an exact re-send resumes from the checkpoint one token short of the prompt's end after one miss
    check(arch, llm, [base])
    assert check(arch, llm, [base])[0].usage.cached_tokens == len(base) - 1
    fork = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=NEW, n=3, ignore_eos=True))[0]
    assert [c.token_ids for c in fork.outputs] == [reference(arch, tuple(turn2), NEW)] * 3
    # a sampled reply to a fresh prompt is cached; greedy replies to it draft from that reply and most of
    # the drafts are rejected: each rejection puts the recurrent state back and recomputes what was kept
    fresh = random_prompts([15], seed=8)[0]
    llm.generate([fresh], SamplingParams(temperature=1.0, max_tokens=NEW, seed=3, ignore_eos=True))
    check(arch, llm, [fresh])
    stats = llm.engine.stats()
    proposed, accepted = sum(stats.spec_proposed.values()), sum(stats.spec_accepted.values())
    assert 0 < accepted < proposed
    assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_survives_preemption_few_state_slots_and_samples_reproducibly(arch: str) -> None:
    # 24 blocks of 4 hold 96 tokens; four 23-token prompts growing by 16 need 40 blocks at once; 3
    # state slots: the fourth sequence waits for one, and checkpoints are evicted to free them
    llm = make(arch, num_blocks=24, new_token_ratio=0.0, state_slots=3)
    prompts = random_prompts([23] * 4, seed=12)
    check(arch, llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert llm.engine.stats().preemptions > 0
    assert llm.engine.stats().state_checkpoints_evicted > 0
    check_seeded_in_a_mixed_batch(llm, prompts)
    # one state slot: a fork finds none free, waits, and computes its prompt itself
    single = make(arch, state_slots=1)
    fork = single.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=NEW, n=2, ignore_eos=True))[0]
    assert [c.token_ids for c in fork.outputs] == [reference(arch, tuple(prompts[1]), NEW)] * 2
    assert_clean(single)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_host_tier_and_cache_off(arch: str) -> None:
    # a pool of 16 blocks: each new conversation evicts the last to the host tier, where it keeps its
    # K/V but not its checkpoint; coming back loads nothing it cannot resume and recomputes correctly
    llm = make(arch, num_blocks=16, host_cache_mb=1)
    convs = random_prompts([30, 30, 30], seed=21)
    check(arch, llm, convs)
    tree = llm.engine.cache.tree
    assert tree is not None and tree.written_back_blocks > 0
    check(arch, llm, convs)
    off = make(arch, enable_prefix_cache=False)
    outs = check(arch, off, random_prompts([9, 30], seed=22))
    assert [o.usage.cached_tokens for o in outs] == [0, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_beam_search_equals_transformers(arch: str) -> None:
    # beams are requests extending cached prefixes: on a hybrid each resumes from a checkpoint
    llm = make(arch)
    prompts = random_prompts([7, 20], seed=31)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert_equal_to_reference(hf_model(tiny_model_dir(arch)), prompts, outs, 2, 1.0, 8, None)
    assert llm.engine.stats().cached_tokens > 0
    assert_clean(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_prompts_arriving_together_share_a_system_prompt(arch: str) -> None:
    # the first prefill stops where the others leave its prompt and checkpoints there; they wait for it
    llm = make(arch)
    system = random_prompts([17], seed=41)[0]
    prompts = [system + random_prompts([5], seed=42 + k)[0] for k in range(4)]
    outs = check(arch, llm, prompts)
    assert sorted(o.usage.cached_tokens for o in outs) == [0, 17, 17, 17]


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("policy, cached", [("request-ends", [0, 0, 0, 0]), ("every-block", [0, 16, 16, 16])])
def test_hybrid_baseline_checkpoint_policies_stay_exact(arch: str, policy: str, cached: list[int]) -> None:
    # request-ends: no checkpoint where the prompts part (17 tokens in); every-block: the last block
    # boundary before it (16), reached by prefills that stop at every block of 4
    llm = make(arch, state_checkpoints=policy)
    system = random_prompts([17], seed=41)[0]
    outs = check(arch, llm, [system + random_prompts([5], seed=42)[0]])
    outs += check(arch, llm, [system + random_prompts([5], seed=42 + k)[0] for k in range(1, 4)])
    assert [o.usage.cached_tokens for o in outs] == cached
    turn2 = system + random_prompts([5], seed=42)[0] + outs[0].outputs[0].token_ids + [7, 8]
    assert check(arch, llm, [turn2])[0].usage.cached_tokens == len(system) + 5 + NEW - 1  # the reply's end


class FailsAfterRunning:
    """Wraps the runner: the first batched forward of two or more items, none at position 0, runs
    (moving their states on), then raises, as a fault late in the step would."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.failed = inner, False

    def run(self, batch: Batch, pending: Any = None, asked: Any = None) -> torch.Tensor:
        logits = self.inner.run(batch, pending, asked)
        if not self.failed and len(batch.items) > 1 and all(it.start > 0 for it in batch.items):
            self.failed = True
            raise RuntimeError("injected after the forward ran")
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_failed_hybrid_forward_fails_its_batch_and_leaves_no_wrong_state(arch: str) -> None:
    llm = make(arch)
    prompts = random_prompts([9, 14], seed=51)
    check(arch, llm, prompts)  # cached, with a checkpoint at each reply's end
    llm.engine.runner = FailsAfterRunning(llm.engine.runner)  # type: ignore[assignment]
    turns = [p + reference(arch, tuple(p), NEW)[:-1] + [7, 8] for p in prompts]  # both resume from a checkpoint
    failed = llm.generate(turns, GREEDY)
    assert [o.outputs[0].finish_reason for o in failed] == ["error", "error"]
    assert [o.usage.cached_tokens for o in check(arch, llm, turns)] == [len(p) + NEW - 1 for p in prompts]
    # fresh prompts fail mid-prefill and mid-decode, where no checkpoint exists yet: none is taken from
    # their half-moved states, so the next turns recompute rather than resume from a wrong one
    llm.engine.runner.failed = False  # type: ignore[attr-defined]
    fresh = random_prompts([30, 30], seed=52)
    assert {o.outputs[0].finish_reason for o in llm.generate(fresh, GREEDY)} == {"error"}
    check(arch, llm, [p + [7, 8] for p in fresh])


# one family per recurrent layer kind: the delta rule, LFM2's short convolution and Mamba2
@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "nemotron_h"])
def test_hybrid_on_the_triton_kernels_matches_transformers(arch: str) -> None:
    """The Triton backend runs the recurrent layers in kernels/recurrent.py too (here under the
    interpreter): cold prefill in chunks, a multi-turn hit resuming mid-block, prompts arriving together,
    and drafts rejected, greedy token for token with transformers."""
    from radixserve.model.causal_conv import CausalConv
    from radixserve.model.mamba2 import Mamba2Mixer

    llm = make(arch, attention_backend="triton", device="cpu", dtype="float32", block_size=16, num_blocks=48,
               max_num_batched_tokens=16, num_speculative_tokens=4)
    recurrent = [m for m in llm.engine.runner.model.modules() if isinstance(m, (GatedDeltaNet, Mamba2Mixer, CausalConv))]
    assert recurrent and {m.implementation for m in recurrent} == {"triton"}
    # decode steps take the padded path (CUDA graphs on GPU): the kernels' item table in static buffers,
    # padding rows fresh in the scratch slot (three prompts together: 3 rows padded to 4)
    decoder = llm.engine.runner.decoder
    assert decoder is not None and decoder.recurrent is not None
    padded_steps = count_calls(decoder, "run")
    base = random_prompts([22], seed=3)[0]
    first = check(arch, llm, [base])[0]
    turn2 = base + first.outputs[0].token_ids + random_prompts([5], seed=4)[0]
    assert check(arch, llm, [turn2])[0].usage.cached_tokens == len(base) + NEW - 1
    system = random_prompts([17], seed=41)[0]
    outs = check(arch, llm, [system + random_prompts([5], seed=42 + k)[0] for k in range(3)])
    assert sorted(o.usage.cached_tokens for o in outs) == [0, 17, 17]
    fresh = random_prompts([15], seed=8)[0]
    llm.generate([fresh], SamplingParams(temperature=1.0, max_tokens=NEW, seed=3, ignore_eos=True))
    check(arch, llm, [fresh])  # drafts from the sampled reply: rejections roll the states back
    check(arch, llm, [turn2])  # drafts from the cached greedy reply: accepted
    stats = llm.engine.stats()
    assert 0 < sum(stats.spec_accepted.values()) < sum(stats.spec_proposed.values())
    assert padded_steps[3] > 0 and padded_steps[1] > 0  # batch sizes the padded path ran
    assert_clean(llm)


def count_calls(decoder: Any, name: str) -> Counter[int]:
    """Counts the padded path's steps by their batch size, from now on."""
    sizes: Counter[int] = Counter()
    run = getattr(decoder, name)

    def counted(batch: Batch, *args: Any, **kwargs: Any) -> Any:
        sizes[len(batch.items)] += 1
        return run(batch, *args, **kwargs)

    setattr(decoder, name, counted)
    return sizes


def test_hybrids_off_the_triton_kernels_decode_eagerly() -> None:
    """The C++ and torch scans take host lists of slots: their decode steps stay off the padded path."""
    for eager in (False, True):
        llm = make("qwen3_5", enforce_eager=eager)
        assert llm.engine.runner.decoder is None and not llm.engine.runner.decodes_padded


# --sliding-window-kv window-blocks: the sliding layers' K/V of cached blocks in window blocks, no checkpoints
WINDOW_BLOCK_ARCHS = ["gemma2", "gemma3", "gemma4", "gpt_oss", "olmo3"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", WINDOW_BLOCK_ARCHS)
def test_window_blocks_resume_at_every_token_equal_to_transformers(arch: str, overlap: bool) -> None:
    llm = make(arch, sliding_window_kv="window-blocks", overlap=overlap, num_speculative_tokens=4)
    assert llm.engine.cache.states is None  # attention reads the window blocks in place: no window states
    base = random_prompts([22], seed=3)[0]
    first = check(arch, llm, [base])[0]
    assert first.usage.cached_tokens == 0
    turn2 = base + first.outputs[0].token_ids + random_prompts([5], seed=4)[0]
    reply_end = len(base) + NEW - 1
    assert check(arch, llm, [turn2])[0].usage.cached_tokens == reply_end and reply_end % 4  # mid-block
    # a prompt leaving the cached path mid-block, inside the first prompt: resumed there at once
    branch = base[:13] + random_prompts([6], seed=6)[0]
    assert check(arch, llm, [branch])[0].usage.cached_tokens == 13
    assert check(arch, llm, [base])[0].usage.cached_tokens == len(base) - 1
    stats = llm.engine.stats()
    assert stats.state_recomputed_tokens == 0 and stats.state_checkpoints == stats.state_checkpoints_taken == 0
    fork = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=NEW, n=3, ignore_eos=True))[0]
    assert [c.token_ids for c in fork.outputs] == [reference(arch, tuple(turn2), NEW)] * 3
    # drafts looked up in a prompt that repeats its start: rejected ones wrote their window rows
    # too, which the kept tokens' recompute overwrites before a later hit reads them
    fresh = random_prompts([15], seed=8)[0]
    prompt = fresh + random_prompts([4], seed=9)[0] + fresh[:3]
    stats = llm.engine.stats()
    proposed, accepted = stats.spec_proposed["lookup"], stats.spec_accepted["lookup"]
    for _ in range(3):  # each turn extends the last, whose reply drafted by lookup
        out = check(arch, llm, [prompt])[0]
        assert out.usage.cached_tokens == 0 or out.usage.cached_tokens == len(prompt) - 2
        prompt = prompt + out.outputs[0].token_ids[:-1] + [3, 4]
    stats = llm.engine.stats()
    proposed, accepted = stats.spec_proposed["lookup"] - proposed, stats.spec_accepted["lookup"] - accepted
    # (the overlapped loop drafts nothing here, and Gemma 4's and gpt-oss's tiny models' greedy replies
    # leave nothing to look up: the other three reject drafts)
    assert overlap or arch in ("gemma4", "gpt_oss") or accepted < proposed
    assert_clean(llm)


@pytest.mark.parametrize("arch", WINDOW_BLOCK_ARCHS)
def test_window_blocks_few_of_them_cut_hits_back_and_stay_exact(arch: str) -> None:
    # 6 window blocks of 4 tokens for pools of 160 KV blocks: most cached blocks lose their window K/V,
    # hits end before the first window reaching one of them, and what they could not restore is counted
    llm = make(arch, sliding_window_kv="window-blocks", window_blocks=6, host_cache_mb=1)
    convs = random_prompts([30, 30, 30], seed=21)
    check(arch, llm, convs)
    outs = check(arch, llm, convs)
    windows = llm.engine.cache.windows
    stats = llm.engine.stats()
    assert windows is not None and stats.window_blocks_evicted == windows.evicted > 0
    assert stats.window_blocks_total == 6 and stats.state_recomputed_tokens > 0
    assert windows.adopted > 0  # what was computed again gave the tree's blocks their window K/V back
    assert all(o.usage.cached_tokens < 29 for o in outs)
    # preemption with few KV blocks, and the host tier: K/V loaded back has no window blocks
    prompts = random_prompts([23] * 4, seed=12)
    for mode in ("recompute", "swap"):  # a swapped sequence resumes as far as its window blocks reach
        small = make(arch, sliding_window_kv="window-blocks", num_blocks=24, new_token_ratio=0.0, host_cache_mb=1,
                     preemption_mode=mode)
        check(arch, small, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        stats = small.engine.stats()
        assert stats.preemptions > 0 and (stats.swaps_out > 0) == (mode == "swap")
        check(arch, small, prompts)
    # the cache off and the fewest window blocks: each sequence's blocks behind its window give theirs
    # up as it goes, and two sequences share what is left
    window = max(a.window or 0 for a in small.engine.model.spec.attentions)
    tight = make(arch, sliding_window_kv="window-blocks", window_blocks=least_window_blocks(window, 4),
                 enable_prefix_cache=False)
    check(arch, tight, random_prompts([41, 30], seed=13))
    assert tight.engine.stats().window_blocks_evicted > 0
    beams = make(arch, sliding_window_kv="window-blocks")
    beam_prompts = random_prompts([7, 20], seed=31)
    out = beams.beam_search(beam_prompts, BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert_equal_to_reference(hf_model(tiny_model_dir(arch)), beam_prompts, out, 2, 1.0, 8, None)
    assert_clean(beams)


def test_window_blocks_on_the_triton_kernels_match_transformers() -> None:
    """The Triton attention kernels (here under the interpreter) read the window group's blocks in place:
    a cold prefill in chunks, a hit mid-block and drafts."""
    llm = make("gemma3", sliding_window_kv="window-blocks", attention_backend="triton", device="cpu", dtype="float32",
               block_size=16, num_blocks=48, max_num_batched_tokens=16, num_speculative_tokens=4)
    assert llm.engine.runner.backend.name == "triton" and llm.engine.cache.windows is not None
    base = random_prompts([22], seed=3)[0]
    first = check("gemma3", llm, [base])[0]
    turn2 = base + first.outputs[0].token_ids + random_prompts([5], seed=4)[0]
    assert check("gemma3", llm, [turn2])[0].usage.cached_tokens == len(base) + NEW - 1
    check("gemma3", llm, [turn2])  # its reply drafted from the cached one
    assert llm.engine.stats().spec_accepted.get("tree", 0) > 0
    assert_clean(llm)


def test_window_blocks_rerun_a_failed_batch_item_by_item() -> None:
    # no state moves in place: as on any paged model, each item runs again on its own and writes the
    # same window rows again
    llm = make("gemma3", sliding_window_kv="window-blocks")
    prompts = random_prompts([9, 14], seed=51)
    check("gemma3", llm, prompts)
    llm.engine.runner = FailsAfterRunning(llm.engine.runner)  # type: ignore[assignment]
    turns = [p + reference("gemma3", tuple(p), NEW)[:-1] + [7, 8] for p in prompts]
    assert [o.usage.cached_tokens for o in check("gemma3", llm, turns)] == [len(p) + NEW - 1 for p in prompts]
    assert llm.engine.runner.failed  # type: ignore[attr-defined]
    assert_clean(llm)


def test_window_blocks_keep_a_shared_prefix_hit_when_the_working_set_outgrows_the_pool() -> None:
    """Six tasks take turns through a pool too small for them all: each task's path is evicted before
    its next turn, so requests find only the prefix they share, which must keep its window blocks to
    be hit (docs/bench/hybrid.md, "A working set larger than the pool")."""
    pool_tokens = 200 * 4
    llm = make("gemma3", sliding_window_kv="window-blocks", num_blocks=200, window_blocks=40, max_num_batched_tokens=64)
    shared, tasks, outs, longest_hits = take_turns(llm, 11)
    assert 6 * len(tasks[0]) > 1.5 * pool_tokens  # the working set outgrew the pool long ago
    assert [o.usage.cached_tokens >= len(shared) for o in outs] == [True] * 6
    # the window blocks of where the waiting requests resume go last (cache/next_reads.py): while the pool
    # holds two paths, a path stays whole each turn (least recently used first, none did past turn 4)
    assert all(hit > len(shared) + 100 for hit in longest_hits[6:10]), longest_hits
    assert_clean(llm)


def test_window_blocks_refuse_a_model_with_recurrent_layers() -> None:
    with pytest.raises(ValueError, match="window-blocks needs a model with sliding-window and full-attention layers"):
        make("qwen3_5", sliding_window_kv="window-blocks")
