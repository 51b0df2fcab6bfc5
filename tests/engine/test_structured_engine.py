"""Structured output in the engine: constraints compiled once and cached, masks on constrained rows
only, matchers per sequence through n > 1 forks, preemption, overlap and prefix hits, forced tokens
in one extend step, and a grammar that breaks ends its request alone.

The tiny random-weight chat model (tests/tiny_models.py) writes whatever its weights say, so every
valid reply here is the grammar's doing; schemas bound their strings and numbers so replies end.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.grammar import GrammarCompiler
from radixserve.engine.grammar import book as grammar_book
from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.errors import ConstraintError
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
# every key fixed and every value from a short enum: most of the reply is forced
FIXED_KEYS = {"type": "object", "additionalProperties": False,
              "required": ["colour", "size", "shape", "material", "finish", "origin"],
              "properties": {"colour": {"enum": ["red", "blue"]}, "size": {"enum": ["small", "large"]},
                             "shape": {"enum": ["round", "square"]}, "material": {"enum": ["wood", "steel"]},
                             "finish": {"enum": ["matte", "gloss"]}, "origin": {"enum": ["north", "south"]}}}
LIST = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "bb", "ccc"]}}


def engine(**overrides: Any) -> LLMEngine:
    config = dict(model=str(tiny_chat_model_dir("llama")), num_blocks=96, max_num_seqs=16)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def run(e: LLMEngine) -> tuple[dict[tuple[str, int], str], dict[tuple[str, int], tuple[str | None, str | None]], int]:
    """Step until done: (text by (request, sample), (finish reason, error) by the same, steps)."""
    texts: dict[tuple[str, int], str] = {}
    ends: dict[tuple[str, int], tuple[str | None, str | None]] = {}
    steps = 0
    while e.has_unfinished() and steps < 2000:
        steps += 1
        for out in e.step():
            for c in out.outputs:
                texts[(out.request_id, c.index)] = texts.get((out.request_id, c.index), "") + c.text
                if c.finish_reason:
                    ends[(out.request_id, c.index)] = (c.finish_reason, out.error)
    assert not e.has_unfinished()
    e.check_integrity()
    assert e.leaked_blocks() == 0
    return texts, ends, steps


def params(structured: StructuredOutput, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "structured": structured, **kw})


# -- the compiler ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return engine().grammars


@pytest.mark.parametrize("constraint", [StructuredOutput(json=PERSON), StructuredOutput(json_object=True),
                                        StructuredOutput(regex=r"[0-9]{3}-[a-z]+"), StructuredOutput(choice=["yes", "no"]),
                                        StructuredOutput(grammar='start: "x" "y"*'),
                                        StructuredOutput(grammar='root ::= "a" | "b" root')])
def test_every_kind_compiles_once_then_comes_from_the_cache(compiler: GrammarCompiler,
                                                            constraint: StructuredOutput) -> None:
    compiled = compiler.compile(constraint)
    hits = compiler.stats.cache_hits
    assert compiler.compile(StructuredOutput(**{constraint.kind: getattr(constraint, constraint.kind)})) is compiled
    assert compiler.stats.cache_hits == hits + 1
    assert compiled.matcher() is not compiled.template  # each sequence its own copy


def test_schema_key_order_is_part_of_the_key() -> None:
    # the order of a schema's properties is the order a reply writes them in (tests/engine/test_grammar_limits.py)
    a = StructuredOutput(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
    b = StructuredOutput(json={"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"})
    assert a.key != b.key


@pytest.mark.parametrize("constraint, words", [
    (StructuredOutput(json={"type": "strng"}, field="response_format.json_schema.schema"),
     ["response_format.json_schema.schema", "strng"]),
    (StructuredOutput(json={"type": "object", "if": {}, "then": {}}, field="guided_json"), ["guided_json", "if"]),
    (StructuredOutput(regex="[0-9", field="structured_outputs.regex"), ["structured_outputs.regex", "regex"]),
    (StructuredOutput(grammar="start: undefined_rule", field="guided_grammar"), ["guided_grammar", "undefined_rule"]),
])
def test_a_constraint_that_cannot_compile_is_refused_naming_its_parameter(compiler: GrammarCompiler,
                                                                          constraint: StructuredOutput,
                                                                          words: list[str]) -> None:
    with pytest.raises(ConstraintError) as refused:
        compiler.compile(constraint)
    assert refused.value.param == constraint.field
    assert all(w in str(refused.value) for w in words), str(refused.value)
    assert compiler.cached(constraint) is None


def test_the_cache_is_bounded_and_a_slow_compile_is_refused(compiler: GrammarCompiler) -> None:
    small = GrammarCompiler(compiler._hf_tokenizer, compiler.vocab_size, compiler.eos_token_ids, cache_size=2)
    for word in ("a", "b", "c"):
        small.compile(StructuredOutput(choice=[word]))
    assert small.cached(StructuredOutput(choice=["a"])) is None and small.cached(StructuredOutput(choice=["c"]))
    too_slow = GrammarCompiler(compiler._hf_tokenizer, compiler.vocab_size, compiler.eos_token_ids,
                               limits=GrammarLimits(compile_timeout_s=1e-3))
    assert too_slow.ll_tokenizer is not None  # built outside the timed compile
    huge = {"type": "object", "required": [f"k{i}" for i in range(0, 3000, 2)],
            "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 5},{i % 5 + 30}}}"} for i in range(3000)}}
    with pytest.raises(ConstraintError, match="did not compile within"):
        too_slow.compile(StructuredOutput(json=huge, field="response_format"))
    assert too_slow.stats.failures == 1


def test_bad_constraint_shapes_are_refused_before_compiling() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json="{nope")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput(choice=[])


def test_the_intake_refuses_a_bad_constraint_before_anything_is_queued() -> None:
    e = engine()
    with pytest.raises(ConstraintError, match="guided_regex"):
        e.add_request("hi", params(StructuredOutput(regex="(", field="guided_regex")))
    assert not e.has_unfinished()


# -- constrained decoding ---------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("forced", [True, False])
def test_constrained_replies_always_validate(overlap: bool, forced: bool) -> None:
    """Greedy and sampled, n > 1 forks, a shared prompt (prefix hits), JSON, regex, choice and a
    grammar in one batch with unconstrained requests: every constrained reply matches."""
    e = engine(overlap=overlap, forced_tokens=forced)
    prompt = "Describe a person as JSON. " * 3
    asks = {
        e.add_request(prompt, params(StructuredOutput(json=PERSON), temperature=0)): PERSON,
        e.add_request(prompt, params(StructuredOutput(json=PERSON), temperature=1.0, n=3, seed=7)): PERSON,
        e.add_request(prompt + "again", params(StructuredOutput(json=LIST), temperature=0.8, seed=3)): LIST,
        e.add_request(prompt, params(StructuredOutput(json=FIXED_KEYS), temperature=1.0, seed=5)): FIXED_KEYS,
    }
    regex = e.add_request("code:", params(StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"), temperature=1.0, seed=1))
    choice = e.add_request("pick:", params(StructuredOutput(choice=["yes", "no", "maybe"]), temperature=1.0, seed=2))
    lark = e.add_request("say:", params(StructuredOutput(grammar='start: "<" NAME ">"\nNAME: /[a-z]{1,4}/'),
                                        temperature=1.0, seed=4))
    free = e.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    texts, ends, _ = run(e)
    for rid, schema in asks.items():
        for index in range(3 if rid == list(asks)[1] else 1):
            assert ends[(rid, index)] == ("stop", None)
            jsonschema.validate(json.loads(texts[(rid, index)]), schema)
    assert len(texts[(regex, 0)]) == 6 and texts[(regex, 0)][3] == "-" and texts[(regex, 0)][:3].isdigit()
    assert texts[(choice, 0)] in ("yes", "no", "maybe")
    assert texts[(lark, 0)].startswith("<") and texts[(lark, 0)].endswith(">")
    assert ends[(free, 0)][0] in ("stop", "length")
    assert e.stats().constrained_requests == 7 and e.stats().mask_steps > 0


def test_an_unconstrained_neighbour_is_untouched() -> None:
    """Masks touch constrained rows only: a greedy unconstrained request decodes the same tokens
    beside constrained ones as alone."""
    alone = engine()
    rid = alone.add_request("The weather today", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    expected = run(alone)[0][(rid, 0)]
    mixed = engine()
    rid = mixed.add_request("The weather today", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for seed in range(3):
        mixed.add_request("The weather today", params(StructuredOutput(json=PERSON), temperature=1.0, seed=seed))
    assert run(mixed)[0][(rid, 0)] == expected


def test_preemption_in_a_tiny_pool_keeps_every_reply_valid() -> None:
    """Sixteen constrained requests in a pool that holds a few of them: preempted (recompute and
    swap), resumed, prefix hits on the shared prompt; every reply still validates, nothing leaks."""
    for mode in ("recompute", "swap"):
        e = engine(num_blocks=24, block_size=4, max_num_seqs=8, preemption_mode=mode,
                   host_cache_mb=4.0 if mode == "swap" else 0.0, new_token_ratio=0.0)
        ids = [e.add_request("Shared system prompt. Person:", params(StructuredOutput(json=PERSON), temperature=1.0,
                                                                     seed=i)) for i in range(16)]
        texts, ends, _ = run(e)
        assert e.stats().preemptions > 0, mode
        for rid in ids:
            assert ends[(rid, 0)] == ("stop", None)
            jsonschema.validate(json.loads(texts[(rid, 0)]), PERSON)


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_tokens_finish_a_fixed_key_schema_in_fewer_steps(overlap: bool) -> None:
    """The grammar forces the keys and punctuation: appended in one extend step each run (with
    overlap, in place of the draw already in flight), the same reply takes at least 1.3x fewer steps
    than sampling them one by one."""
    replies, steps = [], []
    for forced in (True, False):
        e = engine(forced_tokens=forced, overlap=overlap)
        seen: list[int] = []
        e.add_step_observer(lambda info, seen=seen: seen.append(info.forced_tokens))
        rid = e.add_request("Item:", params(StructuredOutput(json=FIXED_KEYS), temperature=0))
        texts, ends, n = run(e)
        replies.append(texts[(rid, 0)])
        steps.append(n)
        assert (e.stats().forced_tokens > 0) == forced and sum(seen) == e.stats().forced_tokens
    jsonschema.validate(json.loads(replies[0]), FIXED_KEYS)
    assert replies[0] == replies[1]
    assert steps[1] >= 1.3 * steps[0], steps


def test_logprobs_come_one_per_token_with_a_constraint() -> None:
    """A forced token has no logprob, so a request that asks for logprobs samples every token."""
    e = engine()
    rid = e.add_request("Item:", params(StructuredOutput(json=FIXED_KEYS), temperature=0, logprobs=2))
    tokens, logprobs, text = 0, 0, ""
    while e.has_unfinished():
        for out in e.step():
            for c in out.outputs:
                tokens, logprobs, text = tokens + len(c.token_ids), logprobs + len(c.logprobs or []), text + c.text
    assert rid and tokens == logprobs > 0
    jsonschema.validate(json.loads(text), FIXED_KEYS)
    assert e.stats().forced_tokens == 0


def test_a_token_the_grammar_rejects_ends_that_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the mask taken away the model samples what the grammar forbids: the matcher rejects it,
    that request ends with an error naming the grammar, the others finish, nothing leaks."""
    e = engine()
    ok = e.add_request("Person:", params(StructuredOutput(json=PERSON), temperature=0))
    free = e.add_request("Person:", SamplingParams(max_tokens=12, temperature=0))
    run_steps = 0
    while e.has_unfinished() and run_steps < 3:  # the first request's grammar is under way
        e.step()
        run_steps += 1
    broken = e.add_request("Person:", params(StructuredOutput(regex="[0-9]{40}"), temperature=1.0, seed=9))
    real_apply = grammar_book.apply_token_bitmask

    def unmask_the_digits(logits: Any, masks: Any) -> None:
        real_apply(logits, masks)
        logits[:, :] = logits.nan_to_num(neginf=0.0)  # every token allowed again for every constrained row

    monkeypatch.setattr(grammar_book, "apply_token_bitmask", unmask_the_digits)
    texts, ends, _ = run(e)
    assert ends[(broken, 0)][0] == "error" and "grammar" in (ends[(broken, 0)][1] or "")
    assert ends[(ok, 0)][0] == "error" or json.loads(texts[(ok, 0)]) is not None  # also unmasked: may break too
    assert ends[(free, 0)][0] in ("stop", "length")
    assert e.stats().grammar_dead_ends >= 1


def test_constraint_figures_reach_stats_json_and_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from radixserve.server.cache_stats import cache_stats_json
    from radixserve.server.metrics import _EngineCollector

    e = engine()
    for seed in range(2):  # the same schema twice: one compile, then a cache hit
        e.add_request("Item:", params(StructuredOutput(json=FIXED_KEYS), temperature=1.0, seed=seed))
    run(e)
    st = e.stats()
    body = cache_stats_json(st, 16, 0, [])["structured_output"]
    assert body["constrained_requests"] == 2 and body["forced_tokens"] == st.forced_tokens > 0
    assert body["compile_cache_hits"] >= 1 and body["mask_steps"] == st.mask_steps > 0
    assert body["mask_ms_per_step"] > 0 and body["dead_ends"] == 0
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: st))
    text = generate_latest(registry).decode()
    assert "radixserve_constrained_requests_total 2.0" in text
    assert f"radixserve_grammar_forced_tokens_total {float(st.forced_tokens)}" in text


def test_the_speculative_hook_rejects_drafts_from_the_first_the_grammar_forbids() -> None:
    e = engine()
    rid = e.add_request("pick:", params(StructuredOutput(choice=["yes", "no"]), temperature=0))
    seq = e.requests[rid].sequences[0]
    tokenizer = e.tokenizer
    yes, no = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("no", add_special_tokens=False)
    eos = sorted(e.eos_token_ids)[0]
    assert e.constraints.draft_prefix(seq, yes + [eos]) == len(yes) + 1  # the reply, then its end
    assert e.constraints.draft_prefix(seq, no[:1] + yes) == 1  # "n" then "yes": only "n" may stand
    assert e.constraints.draft_prefix(seq, yes) == len(yes)  # the matcher was left where it was
    run(e)


def test_special_tokens_reach_the_text_only_when_asked_and_end_tokens_never() -> None:
    """A tool-call marker may be a special token (Mistral's [TOOL_CALLS]): skip_special_tokens=False
    keeps it in the text; the end-of-sequence token stays out either way."""
    from radixserve.engine.detokenizer import IncrementalDetokenizer

    e = engine()
    marker = e.tokenizer.convert_tokens_to_ids("<|im_start|>")
    eos = e.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [marker, *e.tokenizer.encode("ok", add_special_tokens=False), eos]
    for skip, expected in ((True, "ok"), (False, "<|im_start|>ok")):
        detok = IncrementalDetokenizer(e.tokenizer, [], skip, frozenset({eos}))
        detok.add(ids)
        assert detok.delta(final=True) == expected


def test_a_request_counts_one_compile_or_one_cache_hit() -> None:
    e = engine()
    for seed in range(3):
        e.add_request("pick:", params(StructuredOutput(choice=["yes", "no", str(seed % 2)]), temperature=1.0, seed=seed))
    run(e)
    st = e.stats()
    assert (st.grammar_compiles, st.grammar_cache_hits) == (2, 1)


def test_a_matcher_that_missed_tokens_ends_its_request_not_the_engine() -> None:
    """Should a matcher ever be handed a token past one it never saw (a bug), its request ends with
    an error and the engine steps on."""
    from radixserve.engine.grammar.book import SeqMatcher

    e = engine()
    state = SeqMatcher(e.grammars.compile(StructuredOutput(choice=["yes", "no"])).matcher())
    e.constraints._consume(state, 2, 5)  # tokens 0 and 1 were never consumed
    assert state.broken_at == 2 and "lost track" in state.why
