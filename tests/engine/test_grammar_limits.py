"""Structured output under limits (issue 43): a constraint that would crash, stall or exhaust the server
kills or outlasts a compile worker instead, is refused in our words, and never blocks the next compile;
a matcher that hits a limit mid-reply ends that reply alone and leaves the grammar cache; a reply that
stops before its grammar is complete is an error, not a success; a grammar may not name EOS; the cache
keeps a schema's key order and each namespace's own entries.

The tiny random-weight chat model (tests/tiny_models.py) writes whatever its weights say, so what a
reply looks like here is the grammar's doing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.grammar import GrammarCompiler
from radixserve.engine.grammar.book import LIMIT_HIT
from radixserve.engine.grammar.compiler import names_eos
from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.errors import ConstraintError
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput


def engine(**overrides: Any) -> LLMEngine:
    config = dict(model=str(tiny_chat_model_dir("llama")), num_blocks=96, max_num_seqs=16)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def run(e: LLMEngine) -> dict[str, tuple[str, str | None, str | None]]:
    """Step until done: (text, finish reason, error) by request id."""
    texts: dict[str, str] = {}
    ends: dict[str, tuple[str | None, str | None]] = {}
    for _ in range(2000):
        if not e.has_unfinished():
            break
        for out in e.step():
            c = out.outputs[0]
            texts[out.request_id] = texts.get(out.request_id, "") + c.text
            if c.finish_reason:
                ends[out.request_id] = (c.finish_reason, out.error)
    assert not e.has_unfinished()
    e.check_integrity()
    assert e.leaked_blocks() == 0
    return {rid: (texts.get(rid, ""), *ends[rid]) for rid in ends}


def chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, each naming the next: llguidance's compile recurses along it."""
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(rules)) + f'\nr{rules}: "b"\n'


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return engine()


def compiler_like(e: LLMEngine, **limits: Any) -> GrammarCompiler:
    return GrammarCompiler(e.tokenizer, e.spec.vocab_size, sorted(e.eos_token_ids), limits=GrammarLimits(**limits))


def test_a_long_rule_chain_compiles_on_the_big_stack(tiny: LLMEngine) -> None:
    # ~3,000 chained rules overflowed the 8 MB stack the compile used to run on (SIGSEGV, the server gone)
    compiled = tiny.grammars.compile(StructuredOutput(grammar=chain(5000)))
    matcher = compiled.matcher()
    assert not matcher.is_error()
    refs = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}, "$ref": "#/$defs/d0"}
    refs["$defs"]["d5000"] = {"type": "integer"}
    assert tiny.grammars.compile(StructuredOutput(json=refs)) is not None


def test_a_compile_that_kills_its_worker_is_refused_and_the_next_one_compiles(tiny: LLMEngine) -> None:
    compiler = compiler_like(tiny, stack_mb=1)  # so small a stack that the chain overflows it
    with pytest.raises(ConstraintError, match="too large or too deeply chained") as refused:
        compiler.compile(StructuredOutput(grammar=chain(5000), field="structured_outputs.grammar"))
    assert refused.value.param == "structured_outputs.grammar"
    assert compiler.compile(StructuredOutput(regex="x+")) is not None  # a fresh worker took over
    assert compiler.pool.workers_lost == 1 and compiler.stats.failures == 1
    compiler.close()


def test_a_compile_past_the_timeout_is_killed_and_does_not_block_the_next(tiny: LLMEngine) -> None:
    compiler = compiler_like(tiny, compile_timeout_s=0.5, workers=1)
    # GBNF's conversion to Lark marks one more rule of a chain terminal per pass: quadratic, ~8 s here
    slow = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(4000)) + '\nr4000 ::= "a"\n'

    with pytest.raises(ConstraintError, match="did not compile within 0.5 s"):
        compiler.compile(StructuredOutput(grammar=slow))
    assert compiler.pool.workers_lost == 1
    # the one worker was killed, not left running: the next compile gets a fresh one at once
    assert compiler.compile(StructuredOutput(choice=["yes", "no"])) is not None
    compiler.close()


def test_a_worker_over_its_memory_cap_refuses_the_grammar_alone(tiny: LLMEngine) -> None:
    # llguidance's own limits raised out of the way: the worker's address space is what stops this one
    compiler = compiler_like(tiny, worker_memory_mb=400, max_lexer_states=10**7, initial_lexer_fuel=10**10,
                             max_grammar_size=10**8)
    huge = StructuredOutput(regex="(" + "|".join(f"w{i}z[a-z]{{{i % 7}}}" for i in range(60000)) + ")")
    with pytest.raises(ConstraintError, match="too large .* 400 MB of memory"):
        compiler.compile(huge)
    assert compiler.pool.workers_lost == 1
    assert compiler.compile(StructuredOutput(regex="y+")) is not None
    compiler.close()


def test_a_grammar_naming_eos_is_refused() -> None:
    assert names_eos('start: "a" <[2]>', [2], ["<|im_end|>"])
    assert names_eos('start: "a" <[0-5]>', [2], ["<|im_end|>"])
    assert names_eos('start: "a" <[^7]>', [2], ["<|im_end|>"])  # every token but 7: EOS among them
    assert names_eos('start: "a" <|im_end|>', [2], ["<|im_end|>"])
    assert not names_eos('start: "a" <[3-5]>', [2], ["<|im_end|>"])
    assert not names_eos('start: "a" <[^2]>', [2], ["<|im_end|>"])
    e = engine()
    naming = StructuredOutput(grammar=f'start: "a" <[{min(e.eos_token_ids)}]>')
    with pytest.raises(ConstraintError, match="end-of-sequence"):
        e.add_request("hi", SamplingParams(max_tokens=8, structured=naming))


def test_a_limit_hit_mid_reply_ends_that_reply_alone_and_evicts_its_grammar() -> None:
    e = engine()
    # the first mask is fine; each "b" then multiplies the lexer's derivative expressions past the limit
    regex = StructuredOutput(regex="((b{50}){100}){100}", field="structured_outputs.regex")
    blown = e.add_request("hi", SamplingParams(max_tokens=8, temperature=0, structured=regex))
    plain = e.add_request("hi", SamplingParams(max_tokens=8, temperature=0))
    ends = run(e)
    assert ends[blown][1] == "error" and ends[blown][2] == f"structured_outputs.regex: {LIMIT_HIT}"
    assert "lexer" not in LIMIT_HIT and "<state>" not in LIMIT_HIT  # our words, no parser internals
    assert ends[plain][1] == "length"
    assert e.grammars.stats.evictions == 1 and not e.grammars.is_cached(regex)


def test_a_reply_stopped_before_its_grammar_is_complete_is_an_error() -> None:
    e = engine()
    vocab = e.tokenizer.convert_ids_to_tokens(list(range(e.spec.vocab_size)))
    letters = [i for i, t in enumerate(vocab) if t and t.isalpha() and t.islower()]
    grammar = StructuredOutput(grammar='start: /[a-z]{3,9}/ "!"')
    # a stop id the grammar allows mid-way: the reply stops where it could not parse
    cut = e.add_request("hi", SamplingParams(max_tokens=16, temperature=0, structured=grammar, stop_token_ids=letters))
    ends = run(e)
    assert ends[cut][1] == "error" and "before its constraint was complete" in str(ends[cut][2])


def test_the_cache_keeps_a_schemas_key_order_and_each_namespaces_entries(tiny: LLMEngine) -> None:
    ab = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}
    ba = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "boolean"}}, "required": ["a", "b"]}
    assert StructuredOutput(json=ab).key != StructuredOutput(json=ba).key
    compiler = tiny.grammars
    first = compiler.compile(StructuredOutput(json=ab), namespace="tenant-a")
    assert compiler.compile(StructuredOutput(json=ab), namespace="tenant-b") is not first
    assert compiler.compile(StructuredOutput(json=ab), namespace="tenant-a") is first
    e = engine()
    replies = {}
    for name, schema in (("ab", ab), ("ba", ba)):
        rid = e.add_request("hi", SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(json=schema)))
        replies[rid] = name
    for rid, (text, reason, _) in run(e).items():
        assert reason == "stop", text
        assert "".join(json.loads(text)) == replies[rid]  # the keys in the order each schema gives


def test_the_cache_is_bounded_by_its_grammars_estimated_memory(tiny: LLMEngine) -> None:
    compiler = compiler_like(tiny, cache_mb=12)
    chains = [StructuredOutput(grammar=chain(2000).replace('"a"', f'"a{k}"')) for k in range(3)]
    weights = [compiler.compile(c).weight for c in chains]
    assert all(4 << 20 < w < 6 << 20 for w in weights), weights  # ~45 KB of grammar text each
    assert [compiler.is_cached(c) for c in chains] == [False, True, True]  # two fit in 12 MB
    big = StructuredOutput(grammar=chain(12000))  # estimated past the whole budget: used, not kept
    assert compiler.compile(big) is not None and not compiler.is_cached(big)
    assert compiler.is_cached(chains[2])
    # compiled ahead of its check (the server's off-loop compile): kept until the check looks it up
    assert compiler.compile(big, for_a_check=True) is compiler.compile(big)
    compiler.compile(StructuredOutput(regex="z+"))  # the next compile's trim lets it go
    assert not compiler.is_cached(big)
    compiler.close()


def test_every_bench_schema_compiles_under_the_default_limits(tiny: LLMEngine) -> None:
    # the limits bound hostile grammars, not real ones: JSONSchemaBench's kinds and our own catalogue
    from radixserve_bench.structured import catalog_ours
    from radixserve_bench.structured.catalog_jsb import JSB_SCHEMAS

    ours = [x for name in dir(catalog_ours) if isinstance(lst := getattr(catalog_ours, name), list)
            for x in lst if hasattr(x, "schema")]
    schemas = [s.schema for s in [*JSB_SCHEMAS, *ours]]
    assert len(schemas) >= 60
    assert GrammarLimits() == tiny.grammars.limits
    for schema in schemas:
        assert not tiny.grammars.compile(StructuredOutput(json=schema)).matcher().is_error()
