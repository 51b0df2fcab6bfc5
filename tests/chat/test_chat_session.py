"""The offline multi-turn `ChatSession` (LLM.session), priority through LLM.generate / LLM.chat, and the
engine's own inter-token latency figures (Timing), on a tiny random model with a byte-level tokenizer
built here and on the embedded SmolLM2."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from radixserve import LLM, ChatSession, SamplingParams
from radixserve.errors import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer of 256 byte tokens plus <|im_end|> (eos) and <|im_start|>: it fits the tiny
    models' 512-token vocabulary and has no chat template, so the ChatML fallback applies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    from tiny_models import tiny_model_dir

    path = Path(tmp_path_factory.mktemp("tiny-chat")) / "llama"
    shutil.copytree(tiny_model_dir("llama"), path)
    byte_tokenizer().save_pretrained(path)
    return LLM(model=str(path), num_blocks=128, block_size=16)


def spy_priorities(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The priority of each request the scheduler is given, as it reads it."""
    seen: list[int] = []
    scheduler = llm.engine.scheduler
    add = scheduler.add

    def spy(seq: Any) -> None:
        seen.append(seq.request.priority)
        add(seq)

    monkeypatch.setattr(scheduler, "add", spy)
    return seen


def test_session_appends_exact_tokens_and_hits_the_whole_previous_turn(tiny: LLM) -> None:
    chat = tiny.session(system="Be brief.", params=GREEDY)
    assert isinstance(chat, ChatSession) and chat.token_ids == tiny.formatter.system_tokens(chat.messages)
    prev_prompt: list[int] = []
    prev_reply: list[int] = []
    for k, question in enumerate(["Hello there.", "And again?", "One more."]):
        before = list(chat.token_ids)
        out = chat.send(question)
        reply = out.outputs[0].token_ids
        prompt = out.prompt_token_ids
        assert prompt[:len(before)] == before  # appended, never re-tokenized
        if k:
            assert prompt[:len(prev_prompt) + len(prev_reply)] == prev_prompt + prev_reply
            # all of the previous prompt and reply came from the cache, but the last reply token
            # (sampled, never fed back)
            assert out.usage.cached_tokens >= len(prev_prompt) + len(prev_reply) - 1
        closing = tiny.formatter.close_assistant(chat.messages[:-1], reply, tuple(tiny.engine.eos_token_ids))
        assert chat.token_ids == prompt + reply + closing
        assert chat.messages[-2:] == [{"role": "user", "content": question},
                                      {"role": "assistant", "content": out.outputs[0].text}]
        prev_prompt, prev_reply = prompt, reply
    tiny.engine.check_integrity()


def test_session_refuses_n_above_one_and_keeps_its_state_on_refusal(tiny: LLM) -> None:
    chat = tiny.session()
    with pytest.raises(ValueError, match="n must be 1"):
        chat.send("hi", SamplingParams(n=2, max_tokens=2))
    with pytest.raises(RequestError):
        chat.send("hi", GREEDY, priority=True)  # type: ignore[arg-type]
    assert chat.messages == [] and chat.token_ids == []


def test_priority_reaches_the_engine_from_generate_chat_and_session(tiny: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy_priorities(tiny, monkeypatch)
    prompts = [[5, 6, 7], [8, 9, 10]]
    tiny.generate(prompts, GREEDY, priority=-3)
    tiny.generate(prompts, GREEDY, priority=[4, -(2**31)])
    tiny.chat([{"role": "user", "content": "hi"}], GREEDY, priority=9)
    tiny.session(params=GREEDY, priority=2).send("hi")
    tiny.session(params=GREEDY, priority=2).send("hi", priority=1)
    assert seen == [-3, -3, 4, -(2**31), 9, 2, 1]


@pytest.mark.parametrize("bad", [True, 1.5, "1", 2**31 + 1, -(2**31) - 1, [1], [1, 2, 3]])
def test_bad_priorities_are_refused_before_anything_is_queued(tiny: LLM, bad: Any) -> None:
    with pytest.raises(ValueError, match="priority"):  # RequestError is a ValueError
        tiny.generate([[5, 6], [7, 8]], GREEDY, priority=bad)
    assert not tiny.engine.has_unfinished()
    with pytest.raises(RequestError, match="priority"):
        tiny.engine.add_request([5, 6], GREEDY, priority=False)


def test_engine_outputs_carry_inter_token_latency(tiny: LLM) -> None:
    # a prompt no other test sends: without drafts (nothing cached continues it, nothing repeats in
    # it) each step hands out one token, so the gaps are one per token after the first
    out = tiny.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    t = out.timing
    assert out.usage.speculation is None
    assert out.usage.completion_tokens == 6 and t.itl_count == 5  # one gap per token after the first
    assert t.max_itl_ms >= t.mean_itl_ms > 0 and t.last_token is not None and t.first_token is not None
    assert t.mean_itl_ms == pytest.approx((t.last_token - t.first_token) * 1000 / 5, rel=0.1)
    single = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1))[0].timing
    assert (single.itl_count, single.mean_itl_ms, single.max_itl_ms) == (0, 0.0, 0.0)


@pytest.mark.slow
def test_embedded_session_matches_llm_chat_and_computes_only_new_tokens() -> None:
    llm = LLM(max_num_batched_tokens=512, kv_cache_memory_mb=256)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    chat = llm.session(system="You are terse.", params=params)
    prev_len = 0
    for k, question in enumerate(["Hi!", "Name a fruit.", "And a vegetable?"]):
        prompt = chat.formatter.prompt_tokens(chat.messages + [{"role": "user", "content": question}])
        turn = chat.formatter.append_user(chat.messages, question)
        round_trips = prompt == chat.token_ids + turn.user + turn.generation_prompt
        before = llm.engine.stats().computed_tokens
        out = chat.send(question)
        computed = llm.engine.stats().computed_tokens - before
        if k:  # the whole previous conversation (but its unfed last reply token) was cached
            assert out.usage.cached_tokens >= prev_len - 1
            assert computed == out.usage.prompt_tokens - out.usage.cached_tokens
        assert round_trips  # SmolLM2's ChatML round-trips these replies...
        reference = llm.chat(chat.messages[:-1], params)[0].outputs[0]
        assert out.outputs[0].text == reference.text  # ...so LLM.chat gives the same reply
        assert out.outputs[0].token_ids == reference.token_ids
        prev_len = out.usage.prompt_tokens + out.usage.completion_tokens
    assert chat.token_ids == chat.formatter.encode_pieces(chat.formatter.pieces(chat.messages, False))
    llm.engine.check_integrity()


def test_step_info_reports_slot_and_token_budget_utilization(tiny: LLM) -> None:
    from radixserve.core import StepInfo

    steps: list[StepInfo] = []
    tiny.engine.add_step_observer(steps.append)  # stays attached: the module's last use of `tiny`
    tiny.generate([[45, 46, 47], [48, 49]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    cfg = tiny.engine.config
    assert steps and all(s.max_num_seqs == cfg.max_num_seqs for s in steps)
    assert steps[0].slot_utilization == pytest.approx(2 / cfg.max_num_seqs)  # both prompts in one step
    for s in steps:
        assert s.slot_utilization == pytest.approx(s.num_seqs / cfg.max_num_seqs)
        tokens = s.prefill_tokens + s.decode_tokens
        assert s.token_budget_utilization == pytest.approx(tokens / cfg.max_num_batched_tokens) and tokens > 0
