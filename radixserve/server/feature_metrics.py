"""The engine's counters of one feature each, as Prometheus families (server/metrics.py collects them at
scrape time): structured output, the host-memory tier, speculative decoding. Every family is present
from the first scrape, its labels all listed (0 until counted), whether or not the feature is on, so
series never appear or vanish.

Speculative decoding: `radixserve_spec_proposed_tokens_total{source}` and
`radixserve_spec_accepted_tokens_total{source}` (draft tokens verified and kept, every source of
core.DRAFT_SOURCES), `radixserve_spec_verify_draws_total` (sequence-steps that verified drafts),
`radixserve_committed_draws_total` (sequence-steps that committed generated tokens: the rate of
`radixserve_generation_tokens_total` over it is the tokens one sequence gains per step) and the gauge
`radixserve_tokens_per_step`, that ratio since the engine started (1 without speculation, 0 before
the first token).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixserve.core import DRAFT_SOURCES
from radixserve.engine.stats import EngineStats


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=list(labels) if labels else None)
    m.add_metric(list(labels.values()) if labels else [], value)
    return m


def constraint_metrics(st: Any) -> Iterator[Metric]:
    """Structured output: what was constrained, what compiling and masking cost, what was forced."""
    yield counter("radixserve_constrained_requests", "Requests with a structured-output constraint",
                  st.constrained_requests)
    yield counter("radixserve_grammar_compiles", "Constraints compiled (grammar-cache misses)", st.grammar_compiles)
    yield counter("radixserve_grammar_cache_hits", "Constraints found compiled in the grammar cache",
                  st.grammar_cache_hits)
    yield counter("radixserve_grammar_compile_failures", "Constraints refused (invalid, unsupported or too slow)",
                  st.grammar_compile_failures)
    yield counter("radixserve_grammar_compile_seconds", "Time spent compiling constraints", st.grammar_compile_s)
    yield counter("radixserve_grammar_mask_steps", "Steps that masked constrained rows", st.mask_steps)
    yield counter("radixserve_grammar_mask_seconds", "Host time filling token masks", st.mask_s)
    yield counter("radixserve_grammar_forced_tokens", "Tokens a grammar forced, appended without sampling",
                  st.forced_tokens)
    yield counter("radixserve_grammar_dead_ends", "Requests ended because their grammar allowed no token",
                  st.grammar_dead_ends)


def host_tier_metrics(st: EngineStats) -> Iterator[Metric]:
    """The host-memory tier and swap preemption; all 0 while the tier is off, so series never vanish."""
    yield counter("radixserve_prompt_tokens_cached_host", "Prompt tokens served from the cache that were "
                  "loaded back from the host-memory tier", st.host_cached_tokens)
    for direction, prefix, blocks, nbytes, seconds in (
            ("device to host", "write_back", st.written_back_blocks, st.written_back_bytes, st.write_back_s),
            ("host to device", "load_back", st.loaded_blocks, st.loaded_bytes, st.load_s)):
        yield counter(f"radixserve_host_{prefix}_blocks", f"KV blocks copied {direction}", blocks)
        yield counter(f"radixserve_host_{prefix}_bytes", f"Bytes of KV blocks copied {direction}", nbytes)
        yield counter(f"radixserve_host_{prefix}_seconds", f"Time the KV block copies {direction} took", seconds)
    yield counter("radixserve_host_dropped_blocks", "Host-tier blocks dropped (least recently used) to make room",
                  st.host_dropped_blocks)
    swaps = CounterMetricFamily("radixserve_swaps", "Preemptions by swap (out) and swapped sequences resumed (in)",
                                labels=["direction"])
    swaps.add_metric(["out"], st.swaps_out)
    swaps.add_metric(["in"], st.swaps_in)
    yield swaps
    pool = GaugeMetricFamily("radixserve_host_kv_blocks", "Host-tier KV blocks by state", labels=["state"])
    pool.add_metric(["used"], st.host_blocks_total - st.host_blocks_free)
    pool.add_metric(["free"], st.host_blocks_free)
    yield pool
    yield GaugeMetricFamily("radixserve_host_kv_blocks_total", "KV blocks in the host tier (0: off)",
                            value=st.host_blocks_total)


def speculation_metrics(st: EngineStats) -> Iterator[Metric]:
    """Draft tokens proposed and accepted by source, verifying and committing draws, tokens per step."""
    sources = [*DRAFT_SOURCES, *sorted((set(st.spec_proposed) | set(st.spec_accepted)) - set(DRAFT_SOURCES))]
    for name, doc, counts in (
            ("radixserve_spec_proposed_tokens", "Draft tokens verified by speculative decoding, by source",
             st.spec_proposed),
            ("radixserve_spec_accepted_tokens", "Draft tokens verified and kept, by source", st.spec_accepted)):
        fam = CounterMetricFamily(name, doc, labels=["source"])
        for source in sources:
            fam.add_metric([source], counts.get(source, 0))
        yield fam
    yield counter("radixserve_spec_verify_draws", "Sequence-steps that verified draft tokens", st.spec_verify_draws)
    yield counter("radixserve_committed_draws", "Sequence-steps that committed generated tokens (generation "
                  "tokens / this = tokens per sequence per step)", st.committed_draws)
    yield GaugeMetricFamily("radixserve_tokens_per_step", "Generated tokens per sequence per step since start "
                            "(1 without speculation; 0 before the first)", value=st.tokens_per_draw)
