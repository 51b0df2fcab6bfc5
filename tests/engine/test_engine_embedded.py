"""Real checks on the embedded SmolLM2-135M-Instruct: greedy chat output identical to transformers,
a shared system prompt computed once, multi-turn chat that computes only each turn's new tokens,
and the async engine streaming many concurrent callers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from radixserve.model.embedded import embedded_model_dir

SYSTEM = (
    "You are a meticulous assistant for a small library. You answer questions about opening hours, "
    "borrowing rules and the catalogue. Be brief, friendly and precise. "
) * 13
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "Name a primary colour.",
    "What is 2 plus 3?", "Who wrote Hamlet?", "What colour is the sky on a clear day?",
    "Translate 'hello' into Spanish.", "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.", "How many days are in a week?", "What is the largest planet?",
    "Spell the word cat backwards.", "What do bees make?", "Which animal barks?",
    "What is ice made of?", "How many minutes are in an hour?",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # transformers runs the fp32 model: the GGUF's float32 activations with K/V in fp32 (a GGUF's cache is fp16
    # by default) compute exactly that model
    return LLM(max_num_batched_tokens=512, kv_cache_memory_mb=512, quantized_activations="float32", kv_cache_dtype="model")


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_greedy_chat_matches_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    conversations.append([{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "What is the opposite of cold?"}])
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outs = llm.chat(conversations, params)
    for conv, out in zip(conversations, outs):
        ids = chat_ids(llm.tokenizer, conv)
        x = torch.tensor([ids])  # an explicit mask: SmolLM2's pad id is its eos, which chat prompts contain
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == ref[: len(got)] and (len(got) == len(ref) or out.outputs[0].finish_reason == "stop")
        assert out.outputs[0].text == llm.tokenizer.decode(got, skip_special_tokens=True)
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_stop_strings_cut_the_greedy_reply_with_overlap_on_and_off(llm: LLM, overlap: bool) -> None:
    """A stop string ends the reply where its text starts (the text never shows it), the tokens are the
    greedy reply's prefix, and every block is freed, with overlap scheduling on and off."""
    conv = [{"role": "user", "content": "Name three animals that live in the sea."}]
    free = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    words = free.text.split()
    assert len(words) > 4, free.text
    stop = " " + words[3]
    engine = LLM(max_num_batched_tokens=512, kv_cache_memory_mb=64, overlap=overlap, quantized_activations="float32",
                 kv_cache_dtype="model")
    out = engine.chat(conv, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.text.startswith(out.text) and free.text[len(out.text):].startswith(stop)
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    engine.engine.check_integrity()
    assert engine.engine.leaked_blocks() == 0 and engine.engine.stats().blocks_used == 0


def test_shared_system_prompt_is_computed_once(llm: LLM) -> None:
    llm.engine.tree.clear()
    system_ids = chat_ids(llm.tokenizer, [{"role": "system", "content": SYSTEM}])[:-3]
    prompts = [chat_ids(llm.tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    assert all(p[: len(system_ids)] == system_ids for p in prompts) and len(system_ids) >= 380
    before = llm.engine.stats().computed_tokens
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    computed = llm.engine.stats().computed_tokens - before
    questions = sum(len(p) - len(system_ids) for p in prompts)
    assert computed <= len(system_ids) + questions + 16, (computed, len(system_ids), questions)
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0


def test_multi_turn_computes_only_new_tokens(llm: LLM) -> None:
    tok = llm.tokenizer
    history = chat_ids(tok, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    new_tokens = 0  # tokens the previous turn appended after its reply
    unfed = 1  # the previous reply's last token, when it was sampled but never fed
    for turn, question in enumerate(["Name a fruit.", "And a vegetable?", "And a colour?"]):
        before = llm.engine.stats().computed_tokens
        out = llm.generate([history], params)[0]
        computed = llm.engine.stats().computed_tokens - before
        if turn:  # everything but the unfed reply token and the new message was cached
            assert out.usage.cached_tokens == len(history) - new_tokens - unfed
            assert computed == new_tokens + unfed
        # with overlap, the step launched before a stop token resolved already fed it (and cached it);
        # a length limit is known at launch, so that step never ran
        unfed = 0 if llm.engine.config.overlap and out.outputs[0].finish_reason == "stop" else 1
        # append-only: the reply's tokens stay as generated, then the next user message's tokens
        suffix = tok.encode(f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        history = history + out.outputs[0].token_ids + suffix
        new_tokens = len(suffix)
    llm.engine.check_integrity()


def test_host_tier_write_back_load_back_and_swap_match_transformers() -> None:
    """A device pool of 36 blocks (576 tokens) with the host tier on: a second system prompt pushes
    the first to the host tier, its conversations come back loaded rather than recomputed, and all
    eight together need swap preemption; every reply stays greedy-identical to transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    tiered = LLM(max_num_batched_tokens=256, num_blocks=36, host_cache_mb=128, preemption_mode="swap",
                 new_token_ratio=0.0,  # no growth reserve at admission: swaps must happen
                 quantized_activations="float32", kv_cache_dtype="model")  # transformers' fp32 model, exactly
    tok = tiered.tokenizer
    other = "You are a patient tutor of geography and arithmetic. Explain each answer in one sentence. " * 12
    groups = [[chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in QUESTIONS[:4]] for system in (SYSTEM, other)]
    def check(prompts: list[list[int]], max_tokens: int = 12) -> list:
        outs = tiered.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for ids, out in zip(prompts, outs):
            x = torch.tensor([ids])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)[0, len(ids):]
            got = out.outputs[0].token_ids
            assert got == ref.tolist()[:len(got)] and (len(got) == len(ref) or out.outputs[0].finish_reason == "stop")
        tiered.engine.check_integrity()
        assert tiered.engine.leaked_blocks() == 0
        return outs

    check(groups[0])
    check(groups[1])
    assert tiered.engine.stats().written_back_blocks > 0
    again = check(groups[0])
    assert all(o.usage.host_cached_tokens > 0 for o in again)
    long_replies = ["Count from one to forty in words.", "Write a long story about a dragon and a knight.",
                    "List twenty animals, one per line.", "Describe the water cycle step by step in detail."]
    busy = [chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
            for system in (SYSTEM, other) for q in long_replies]
    check(busy, max_tokens=32)  # eight growing replies outgrow the pool: swap preemption
    st = tiered.engine.stats()
    assert st.swaps_out > 0 and st.swaps_in == st.swaps_out and st.loaded_blocks > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_async_engine_streams_concurrent_requests(overlap: bool) -> None:
    """Concurrent streams, and a caller that walks away mid-stream (a disconnect): its request is
    aborted and every block freed, with overlap on (its next token in flight) and off."""
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(max_num_batched_tokens=256, overlap=overlap))
        await engine.start()
        tok = engine.tokenizer
        prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS[:6]]

        async def run(p: list[int]) -> tuple[str, list]:
            text, outs = "", []
            async for out in engine.generate(p, SamplingParams(temperature=0.0, max_tokens=8)):
                text += out.outputs[0].text if out.outputs else ""
                outs.append(out)
            return text, outs

        results = await asyncio.gather(*(run(p) for p in prompts))
        for text, outs in results:
            assert outs[-1].finished and sum(o.finished for o in outs) == 1
            ids = [t for o in outs for c in o.outputs for t in c.token_ids]
            assert text == tok.decode(ids, skip_special_tokens=True)
            assert outs[-1].timing.ttft_ms > 0 and outs[-1].usage.completion_tokens == len(ids)

        # abandoning a stream aborts the request and frees its blocks
        agen = engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats().blocks_used == 0
        engine.check_integrity()
        assert engine.leaked_blocks() == 0
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], SamplingParams()):
                pass
        await engine.shutdown()

    asyncio.run(main())
