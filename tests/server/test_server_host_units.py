"""The host-memory tier on the server's surfaces, without a server or a model: a made-up EngineStats
fed to the /v1/cache/stats body and the Prometheus collector, and a made-up Usage fed to the OpenAI,
session-turn and terminal-chat renderings. End to end against a real server: test_server_host_tier.py."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.core import RequestOutput, Timing, Usage
from radixserve.engine.stats import EngineStats
from radixserve.server.cache_stats import cache_stats_json
from radixserve.server.metrics import _EngineCollector
from radixserve.server.openai_chat.shapes import usage_body
from radixserve.server.sessions.turns import usage_json
from radixserve.terminal_chat import _figures

# the keys /v1/cache/stats had before the host tier: kept, with the same meaning
PRE_HOST_KEYS = {"hit_rate", "prompt_tokens", "cached_tokens", "computed_tokens", "generation_tokens", "requests",
                 "hit_requests", "request_hit_rate", "blocks", "tree", "evictions", "evicted_blocks", "preemptions",
                 "running", "waiting", "sessions", "system_prompts"}


def tiered_stats() -> EngineStats:
    """Every figure distinct, so a value shown under the wrong key cannot pass."""
    return EngineStats(
        blocks_total=64, blocks_free=10, blocks_used=30, blocks_cached=24, tree_nodes=7, tree_tokens=500,
        num_running=3, num_waiting=2, prompt_tokens=1000, cached_tokens=600, computed_tokens=410,
        generation_tokens=90, cache_hit_requests=4, requests_finished=Counter(stop=5, length=1), evictions=11,
        evicted_blocks=13, preemptions=6,
        host_blocks_total=256, host_blocks_free=200, host_nodes=5, host_tokens=880, host_cached_tokens=240,
        written_back_blocks=70, written_back_bytes=70 * 4096, write_back_s=0.125, loaded_blocks=15,
        loaded_bytes=15 * 4096, load_s=0.0625, host_dropped_blocks=14, swaps_out=4, swaps_in=3)


def test_cache_stats_json_has_the_host_tier() -> None:
    table = [{"id": "none", "preview": "(no system prompt)"}]
    body = cache_stats_json(tiered_stats(), 16, 9, table)
    assert body.keys() >= PRE_HOST_KEYS
    assert body["hit_rate"] == 0.6 and body["requests"] == 6 and body["sessions"] == 9
    assert body["blocks"] == {"total": 64, "free": 10, "used": 30, "cached": 24, "block_size": 16}
    assert body["system_prompts"] is table
    assert body["host_cached_tokens"] == 240
    assert body["swaps"] == {"out": 4, "in": 3}
    assert body["host"] == {
        "enabled": True, "blocks": {"total": 256, "free": 200, "used": 56}, "nodes": 5, "tokens": 880,
        "hit_tokens": 240, "write_back": {"blocks": 70, "bytes": 286720, "seconds": 0.125},
        "load_back": {"blocks": 15, "bytes": 61440, "seconds": 0.0625}, "dropped_blocks": 14}


def test_cache_stats_json_with_the_host_tier_off_keeps_every_key() -> None:
    body = cache_stats_json(EngineStats(blocks_total=8, blocks_free=8), 16, 0, [])
    on = cache_stats_json(tiered_stats(), 16, 0, [])
    assert body.keys() == on.keys() and body["host"].keys() == on["host"].keys()
    assert body["host"]["enabled"] is False
    assert body["host"]["blocks"] == {"total": 0, "free": 0, "used": 0}
    assert body["host_cached_tokens"] == 0 and body["swaps"] == {"out": 0, "in": 0}
    assert body["hit_rate"] == 0.0 and body["request_hit_rate"] == 0.0


def scrape(st: EngineStats) -> dict[str, float]:
    """What /metrics shows for these stats: {sample name{labels}: value}."""
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: st))
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_have_the_host_tier() -> None:
    m = scrape(tiered_stats())
    assert m["radixserve_prompt_tokens_cached_total"] == 600  # unchanged beside the host share
    assert m["radixserve_prompt_tokens_cached_host_total"] == 240
    assert m["radixserve_host_write_back_blocks_total"] == 70
    assert m["radixserve_host_write_back_bytes_total"] == 286720
    assert m["radixserve_host_write_back_seconds_total"] == 0.125
    assert m["radixserve_host_load_back_blocks_total"] == 15
    assert m["radixserve_host_load_back_bytes_total"] == 61440
    assert m["radixserve_host_load_back_seconds_total"] == 0.0625
    assert m["radixserve_host_dropped_blocks_total"] == 14
    assert m["radixserve_swaps_total{direction=out}"] == 4
    assert m["radixserve_swaps_total{direction=in}"] == 3
    assert m["radixserve_host_kv_blocks{state=used}"] == 56
    assert m["radixserve_host_kv_blocks{state=free}"] == 200
    assert m["radixserve_host_kv_blocks_total"] == 256
    assert m["radixserve_kv_blocks_total"] == 64 and m["radixserve_preemptions_total"] == 6


def test_metrics_of_a_server_without_the_host_tier_are_zero_not_missing() -> None:
    on, off = scrape(tiered_stats()), scrape(EngineStats())
    assert on.keys() == off.keys()
    assert all(v == 0 for k, v in off.items() if "host" in k or "swaps" in k)


def output(usage: Usage) -> RequestOutput:
    return RequestOutput("r", [], usage, Timing())


def test_usage_carries_host_cached_tokens() -> None:
    out = output(Usage(prompt_tokens=120, cached_tokens=96, completion_tokens=8, host_cached_tokens=64))
    body = usage_body(out)
    assert body.pop("completion_tokens_details")["accepted_prediction_tokens"] == 0  # tests/server/test_server_prediction.py
    assert body == {"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128,
                    "prompt_tokens_details": {"cached_tokens": 96, "host_cached_tokens": 64}}
    turn = usage_json(out)
    assert turn.pop("speculation")["proposed"] == 0
    assert turn == {"prompt_tokens": 120, "cached_tokens": 96, "host_cached_tokens": 64, "completion_tokens": 8}


def test_terminal_chat_names_host_tokens_only_when_there_are_some() -> None:
    line = _figures(output(Usage(prompt_tokens=120, cached_tokens=96, completion_tokens=8, host_cached_tokens=64)))
    assert "cached 96/120 prompt tokens (80%, 64 loaded from host memory)" in line
    line = _figures(output(Usage(prompt_tokens=120, cached_tokens=96, completion_tokens=8)))
    assert "cached 96/120 prompt tokens (80%)" in line and "host" not in line
