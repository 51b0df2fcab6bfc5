"""The engine against transformers as the oracle (greedy, fp32, token for token) on tiny
random-weight models of every supported architecture, through every cache path: cold, warm, chunk
boundaries at every offset inside a block, hits ending mid-block (copy-on-write), preemption in a
tiny pool, n > 1 forks, and mixed batches. Every test ends with the integrity check and 0 leaks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from tiny_models import hf_model, tiny_model_dir

from radixserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# decode steps take the padded static-buffer path (CUDA graphs on GPU) unless enforce_eager; each
# with overlap scheduling (step N+1 launched before step N resolves) and without
PATHS = [pytest.param(eager, overlap, id=f"{'eager' if eager else 'padded'}-{'overlap' if overlap else 'sync'}")
         for eager in (False, True) for overlap in (True, False)]


@functools.cache
def reference(arch: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    model = hf_model(tiny_model_dir(arch))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def make_llm(arch: str, **kw) -> LLM:
    kw = {"block_size": 16, "num_blocks": 96, "max_num_batched_tokens": 64} | kw
    return LLM(model=str(tiny_model_dir(arch)), **kw)


def assert_matches(arch: str, llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert c.token_ids == reference(arch, tuple(p), params.max_tokens), f"prompt of {len(p)} tokens diverged"
    assert_clean(llm)
    return outs


def assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0
    assert llm.engine.stats().blocks_used == 0


@pytest.mark.parametrize("eager, overlap", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_cold_then_warm_cache_matches_transformers(arch: str, eager: bool, overlap: bool) -> None:
    llm = make_llm(arch, enforce_eager=eager, overlap=overlap)
    prompts = random_prompts([1, 15, 16, 17, 40, 90])  # mixed lengths in one batch, block edges
    cold = assert_matches(arch, llm, prompts)
    assert [o.usage.cached_tokens for o in cold] == [0] * len(prompts)
    warm = assert_matches(arch, llm, prompts)
    # a whole-prompt hit recomputes only the last prompt token, for its logits
    assert [o.usage.cached_tokens for o in warm] == [len(p) - 1 for p in prompts]


@pytest.mark.parametrize("eager, overlap", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_hits_ending_mid_block_copy_on_write(arch: str, eager: bool, overlap: bool) -> None:
    llm = make_llm(arch, enforce_eager=eager, overlap=overlap)
    base = random_prompts([60], seed=1)[0]
    assert_matches(arch, llm, [base])
    before = llm.engine.stats().computed_tokens
    branches = [base[:k] + random_prompts([9], seed=k)[0] for k in (5, 21, 33, 47)]  # diverge mid-block
    outs = assert_matches(arch, llm, branches)
    for k, o in zip((5, 21, 33, 47), outs):
        assert o.usage.cached_tokens >= k  # the shared part of the partial block was reused, not recomputed
    computed = llm.engine.stats().computed_tokens - before
    assert computed == sum(len(b) - o.usage.cached_tokens for b, o in zip(branches, outs))


@pytest.mark.parametrize("budget", range(16, 32))
def test_chunk_boundaries_at_every_offset(budget: int) -> None:
    llm = make_llm("llama", max_num_batched_tokens=budget)
    assert_matches("llama", llm, random_prompts([100, 45], seed=2))


@pytest.mark.parametrize("eager, overlap", PATHS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_in_a_tiny_pool(arch: str, eager: bool, overlap: bool) -> None:
    # 8 blocks of 16 hold 128 tokens; six 40-token prompts growing by 16 need 24 blocks at once
    llm = make_llm(arch, num_blocks=8, max_num_batched_tokens=48, enforce_eager=eager, overlap=overlap,
                   new_token_ratio=0.0)  # admission without a growth reserve: preemption is what is tested
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([40] * 6, seed=3)
    assert_matches(arch, llm, prompts, params)
    assert llm.engine.stats().preemptions > 0
    assert llm.engine.stats().evictions > 0


def take_turns(llm: LLM, turns: int) -> tuple[list[int], list[list[int]], list, list[int]]:
    """Six tasks sharing a 40-token prefix take `turns` turns, all sent at once in the same order each
    turn (a 4-token greedy reply, then 16 new tokens): the prefix, the last turn's prompts and replies,
    and each turn's longest hit."""
    shared = random_prompts([40], seed=61)[0]
    tasks = [shared + p for p in random_prompts([8] * 6, seed=62)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    longest_hits: list[int] = []
    outs: list = []
    for turn in range(turns):
        if turn:
            tasks = [t + o.outputs[0].token_ids + extra
                     for t, o, extra in zip(tasks, outs, random_prompts([16] * 6, seed=69 + turn))]
        outs = llm.generate(tasks, params)
        longest_hits.append(max(o.usage.cached_tokens for o in outs))
    return shared, tasks, outs, longest_hits


@pytest.mark.parametrize("lookahead", [0, 64])
def test_tasks_taking_turns_through_a_pool_too_small_for_them_all_keep_some_paths_whole(lookahead: int) -> None:
    """Six tasks take turns (all sent at once, in the same order each turn) through a pool that holds
    fewer than half of their paths. Least recently used first (lookahead 0) evicts each path just
    before its task's next turn, so from turn 8 on every request reads only the prefix all share.
    Eviction keeping for last what the waiting requests will read, the one admitted last first
    (cache/next_reads.py), keeps some paths whole."""
    llm = make_llm("llama", block_size=4, num_blocks=200, eviction_lookahead=lookahead)
    shared, tasks, outs, longest_hits = take_turns(llm, 12)
    assert 6 * len(tasks[0]) > 2 * 200 * 4  # the working set outgrew the pool
    if lookahead:
        assert all(hit > len(shared) + 100 for hit in longest_hits[8:]), longest_hits
    else:
        assert longest_hits[8:] == [len(shared)] * 4
    for task, out in zip(tasks, outs):
        assert out.outputs[0].token_ids == reference("llama", tuple(task), 4)
    assert_clean(llm)


@pytest.mark.parametrize("eager, overlap", PATHS)
def test_n_forks_share_the_prompt(eager: bool, overlap: bool) -> None:
    llm = make_llm("qwen2", enforce_eager=eager, overlap=overlap)
    prompt = random_prompts([37], seed=4)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, n=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert all(c.token_ids == reference("qwen2", tuple(prompt), 10) for c in out.outputs)
    assert llm.engine.stats().computed_tokens == len(prompt)  # the prompt ran once for all 3 samples
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_samples_differ() -> None:
    llm = make_llm("llama")
    prompt = random_prompts([20], seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=12, n=4, seed=7, ignore_eos=True)
    a = llm.generate([prompt], params)[0]
    # the same seed in a different batch (with an unseeded neighbour) gives the same samples
    b = llm.generate([prompt, prompt[:5]], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert_clean(llm)


NEIGHBOURS = [  # other requests sharing the batch, each with different settings
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=5, max_tokens=15, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, top_p=0.7, max_tokens=4, ignore_eos=True, seed=99),
    SamplingParams(temperature=0.5, max_tokens=20, n=2, ignore_eos=True, logprobs=2),
]


def seeded_runs(make: Callable[..., LLM]) -> list[list[list[int]]]:
    """A seeded n=2 request's samples alone and inside a batch of NEIGHBOURS, with overlap on and off
    (`make(overlap=...)` builds the engine): four runs that must be equal."""
    prompt = random_prompts([23], seed=8)[0]
    others = random_prompts([5, 40, 17, 31], seed=9)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, max_tokens=14, n=2, seed=1234,
                            ignore_eos=True)
    runs = []
    for overlap in (True, False):
        llm = make(overlap=overlap)
        runs.append([c.token_ids for c in llm.generate([prompt], seeded)[0].outputs])
        for other, params in zip(others, NEIGHBOURS):
            llm.engine.add_request(other, params)  # queued first: they run in the same steps
        runs.append([c.token_ids for c in llm.generate([prompt], seeded)[0].outputs])
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert_clean(llm)
    return runs


@pytest.mark.parametrize("eager", [False, True], ids=["padded", "eager"])
def test_a_seeded_request_is_the_same_alone_and_in_any_batch(eager: bool) -> None:
    """Its tokens are a function of (seed, sample index, position) and the logits: the same alone, in
    a batch of requests with other settings, and with overlap scheduling on or off."""
    runs = seeded_runs(lambda overlap: make_llm("llama", enforce_eager=eager, overlap=overlap))
    assert all(r == runs[0] for r in runs) and runs[0][0] != runs[0][1]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_stop_token_and_eos(overlap: bool) -> None:
    llm = make_llm("llama", overlap=overlap)
    prompt = random_prompts([12], seed=6)[0]
    ref = reference("llama", tuple(prompt), 10)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ref[3]]))[0]
    first = ref.index(ref[3])
    assert out.outputs[0].token_ids == ref[: first + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == ref[3]  # the stop id that ended it (vLLM's stop_reason)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[ref[3]]))[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert_clean(llm)


def test_cache_off_computes_everything() -> None:
    llm = make_llm("llama", enable_prefix_cache=False)
    prompts = random_prompts([30, 30], seed=8)
    assert_matches("llama", llm, prompts)
    assert_matches("llama", llm, prompts)
    assert llm.engine.stats().computed_tokens == 2 * 60
    assert llm.engine.stats().blocks_free == 96


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], GREEDY, "empty"),
        ([1, 2, 512], GREEDY, "outside the vocabulary"),
        ([1, -1], GREEDY, "outside the vocabulary"),
        ([1] * 2000, GREEDY, "context length"),
        ("hello", GREEDY, "no tokenizer"),
        ([1, 2.5], GREEDY, "integer token ids"),
    ],
)
def test_bad_requests_are_rejected_without_leaks(prompt, params, message) -> None:
    llm = make_llm("llama")
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params)
    assert not llm.engine.has_unfinished()
    assert_clean(llm)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -3), ("n", 0), ("top_p", 0.0),
                                          ("temperature", -1.0), ("top_k", -1)])
def test_bad_sampling_params(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_model_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize("eager", [False, True], ids=["padded", "eager"])
def test_aborts_and_stops_while_a_step_is_in_flight_free_every_block(eager: bool) -> None:
    """With overlap, a request aborted (or stopped) while its next token is still in flight ends at
    once, its in-flight token is dropped, and no block leaks; the others match transformers."""
    llm = make_llm("llama", enforce_eager=eager, overlap=True)
    engine = llm.engine
    prompts = random_prompts([30, 18, 45, 9], seed=10)
    ref = [reference("llama", tuple(p), 10) for p in prompts]
    stopper = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ref[3][4]])
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]] + [engine.add_request(prompts[3], stopper)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finish: dict[str, str | None] = {}
    aborted_in_flight = False
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
        if len(tokens[ids[1]]) >= 3 and ids[1] not in finish:
            assert engine._in_flight is not None  # its next token is on the device right now
            out = engine.abort(ids[1])
            assert out is not None and out.finished
            tokens[ids[1]] += out.outputs[0].token_ids
            finish[ids[1]] = out.outputs[0].finish_reason
            aborted_in_flight = True
            engine.check_integrity()
    assert aborted_in_flight and not engine.has_unfinished()
    assert finish == {ids[0]: "length", ids[1]: "abort", ids[2]: "length", ids[3]: "stop"}
    assert tokens[ids[0]] == ref[0] and tokens[ids[2]] == ref[2]
    assert tokens[ids[1]] == ref[1][:len(tokens[ids[1]])] and 3 <= len(tokens[ids[1]]) < 10
    assert tokens[ids[3]] == ref[3][:ref[3].index(ref[3][4]) + 1]
    assert_clean(llm)


def test_logprobs_per_request_in_a_shared_batch() -> None:
    """`SamplingParams.logprobs=k`: one entry per generated token with exactly k alternatives, even
    when a request asking for more shares the batch; greedy picks the top alternative; the values are
    the model's log-softmax (checked against transformers' logits for the first token)."""
    llm = make_llm("llama")
    prompts = random_prompts([13, 21, 8], seed=11)
    asks = [None, 0, 4]
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k))
           for p, k in zip(prompts, asks)]
    got: dict[str, list] = {i: [] for i in ids}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            c = out.outputs[0]
            assert (c.logprobs is None) == (asks[ids.index(out.request_id)] is None)
            assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
            got[out.request_id] += c.logprobs or []
    assert got[ids[0]] == [] and len(got[ids[1]]) == len(got[ids[2]]) == 6
    assert all(t.top == () for t in got[ids[1]])
    for t in got[ids[2]]:
        assert len(t.top) == 4 and t.top[0][0] == t.token_id and t.top[0][1] == pytest.approx(t.logprob)
        assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
    first = torch.log_softmax(hf_model(tiny_model_dir("llama"))(torch.tensor([prompts[2]])).logits[0, -1].float(), -1)
    assert got[ids[2]][0].logprob == pytest.approx(float(first.max()), abs=1e-4)
    offline = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4))
    alone = offline[0].outputs[0].logprobs  # LLM.generate folds them too (the batch differs: last bits may)
    assert alone is not None and [t.token_id for t in alone] == [t.token_id for t in got[ids[2]]]
    assert [t.logprob for t in alone] == pytest.approx([t.logprob for t in got[ids[2]]], abs=1e-5)
    assert_clean(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_observers_split_prefill_from_decode_tokens(overlap: bool) -> None:
    """A prompt's chunk counts as prefill and each later one-token step as decode: the split is read
    before the launch appends the pending slots (after it no chunk reaches its sequence's end)."""
    llm = make_llm("llama", overlap=overlap, num_speculative_tokens=0)
    steps: list = []
    llm.engine.add_step_observer(steps.append)
    llm.generate([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert (steps[0].prefill_tokens, steps[0].decode_tokens) == (20, 0)
    decodes = [s for s in steps[1:] if s.num_seqs]
    assert len(decodes) == 5 and all((s.prefill_tokens, s.decode_tokens) == (0, 1) for s in decodes)
