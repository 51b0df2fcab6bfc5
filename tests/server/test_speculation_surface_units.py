"""Speculative decoding on the server's surfaces, without a server or a model: the `prediction` reader
(every refusal names the field), a made-up DraftCounts rendered into the OpenAI, session-turn,
Responses and terminal-chat usage, and a made-up EngineStats fed to the Prometheus collector and the
/v1/cache/stats body. End to end against a real server: test_server_prediction.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from radixserve.core import DRAFT_SOURCES, DraftCounts, Usage
from radixserve.engine.stats import EngineStats
from radixserve.sampling_fields import Api, SamplingFields
from radixserve.sampling_params import MAX_PREDICTION_LENGTH
from radixserve.server.cache_stats import cache_stats_json
from radixserve.server.completions.api import _Run
from radixserve.server.completions.request import CompletionRequest
from radixserve.server.openai_chat.shapes import usage_body
from radixserve.server.pipeline.ask import Ask, TextPrompts
from radixserve.server.pipeline.logprobs import TokenTexts
from radixserve.server.pipeline.plan import Plan
from radixserve.server.pipeline.prediction import merged_drafts, prediction_text, speculation_json, with_prediction
from radixserve.server.pipeline.sampling import build_sampling_params
from radixserve.server.pipeline.stream import SystemPromptRef
from radixserve.server.responses.events import usage_object
from radixserve.server.sessions.turns import usage_json
from radixserve.server.validation import ApiError
from radixserve.terminal_chat import _figures

pytest.register_assert_rewrite("test_server_host_units")
from test_server_host_units import output, scrape  # noqa: E402


def drafts() -> DraftCounts:
    """Every figure distinct: tree 10 proposed / 6 kept, prediction 20 / 15 of a 26-token prediction,
    in 7 verifying steps."""
    d = DraftCounts(prediction_tokens=26)
    for source, proposed, accepted in (("tree", 4, 2), ("prediction", 12, 10), ("tree", 6, 4), ("prediction", 8, 5),
                                       ("prediction", 0, 0), ("tree", 0, 0), ("prediction", 0, 0)):
        d.add(source, proposed, accepted)
    return d


def test_prediction_text_reads_openai_shapes() -> None:
    assert prediction_text({}) is None and prediction_text({"prediction": None}) is None
    assert prediction_text({"prediction": {"type": "content", "content": "def f(): pass"}}) == "def f(): pass"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b\n"}]
    assert prediction_text({"prediction": {"type": "content", "content": parts}}) == "ab\n"
    assert prediction_text({"prediction": {"type": "content", "content": ""}}) is None  # empty: no prediction
    assert prediction_text({"prediction": {"type": "content", "content": []}}) is None
    assert with_prediction(SamplingFields(temperature=0.0), {}) == SamplingFields(temperature=0.0)
    assert with_prediction(SamplingFields(), {"prediction": {"type": "content", "content": "x"}}) == \
        SamplingFields(prediction="x")


@pytest.mark.parametrize("value,param", [
    ("just text", "prediction"), (["x"], "prediction"), (7, "prediction"),
    ({"content": "x"}, "prediction.type"), ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"), ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": {"text": "x"}}, "prediction.content"),
    ({"type": "content", "content": ["x"]}, "prediction.content[0]"),
    ({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
     "prediction.content[1]"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, "prediction.content[0]"),
    ({"type": "content", "content": "x" * (MAX_PREDICTION_LENGTH + 1)}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": "x" * MAX_PREDICTION_LENGTH},
                                     {"type": "text", "text": "y"}]}, "prediction.content"),
])
def test_a_malformed_prediction_is_a_400_naming_it(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        prediction_text({"prediction": value})
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_field", param)
    assert f"'{param}'" in e.value.message


def test_sampling_params_carry_the_prediction_ids() -> None:
    params = build_sampling_params(SamplingFields(prediction=[5, 6, 7], temperature=0.0), prompt_len=4,
                                   max_model_len=64, default_max_tokens=8)
    assert params.prediction == [5, 6, 7] and params.max_tokens == 8
    assert build_sampling_params(SamplingFields(), prompt_len=4, max_model_len=64, default_max_tokens=8).prediction is None


def test_speculation_json_lists_every_source() -> None:
    assert speculation_json(None) == {"proposed": 0, "accepted": 0, "verify_steps": 0, "prediction_tokens": 0,
                                      "by_source": {s: {"proposed": 0, "accepted": 0} for s in DRAFT_SOURCES}}
    got = speculation_json(drafts())
    assert got == {"proposed": 30, "accepted": 21, "verify_steps": 7, "prediction_tokens": 26, "by_source": {
        "tree": {"proposed": 10, "accepted": 6}, "prediction": {"proposed": 20, "accepted": 15},
        "lookup": {"proposed": 0, "accepted": 0}}}
    assert list(got["by_source"]) == list(DRAFT_SOURCES)


def test_openai_usage_has_the_prediction_counts_and_speculation() -> None:
    u = Usage(prompt_tokens=50, cached_tokens=16, completion_tokens=40, speculation=drafts())
    details = usage_body(output(u))["completion_tokens_details"]
    # OpenAI's: the prediction's tokens kept, and the rest of the prediction
    assert details["accepted_prediction_tokens"] == 15 and details["rejected_prediction_tokens"] == 11
    assert details["speculation"] == speculation_json(drafts())
    plain = usage_body(output(Usage(prompt_tokens=5, completion_tokens=3)))["completion_tokens_details"]
    assert (plain["accepted_prediction_tokens"], plain["rejected_prediction_tokens"]) == (0, 0)
    assert plain["speculation"]["by_source"]["prediction"] == {"proposed": 0, "accepted": 0}


def test_the_session_turn_responses_and_terminal_usage_carry_the_drafts() -> None:
    u = Usage(prompt_tokens=50, cached_tokens=16, completion_tokens=40, speculation=drafts())
    assert usage_json(output(u))["speculation"] == speculation_json(drafts())
    assert usage_object(u)["output_tokens_details"] == {"reasoning_tokens": 0, "speculation": speculation_json(drafts())}
    assert "(21 drafted)" in _figures(output(u))
    assert "drafted" not in _figures(output(Usage(prompt_tokens=5, completion_tokens=3)))


def test_completions_usage_sums_the_prompts_drafts() -> None:
    other = DraftCounts(prediction_tokens=4)  # a prompt whose prediction drafted more than its length
    other.add("lookup", 3, 1)
    other.add("prediction", 6, 6)
    total = merged_drafts([drafts(), None, other])
    assert total is not None and (total.proposed, total.accepted, total.verify_steps) == (39, 28, 9)
    assert total.by_source == {"tree": [10, 6], "prediction": [26, 21], "lookup": [3, 1]}
    assert total.prediction_tokens == 30
    assert merged_drafts([None, None]) is None
    assert merged_drafts([DraftCounts(prediction_tokens=3)]) is not None  # predicted, nothing drafted
    ask = Ask(Api.COMPLETIONS, TextPrompts([]), SamplingFields(), "default")
    req = CompletionRequest("m", Plan(ask, [], SystemPromptRef.none("default")), False, [], False, None, None)
    run = _Run(req, TokenTexts(None), [], [Usage(10, 0, 4, speculation=drafts()), Usage(12, 0, 5, speculation=other)],
               [None, None])
    details = run.usage_body()["completion_tokens_details"]
    # each prompt's own counts summed: (15 + 4, 11 + 0), not the sum's (min(30, 21), 30 - 21)
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (19, 11)
    assert details["speculation"]["by_source"]["lookup"] == {"proposed": 3, "accepted": 1}
    assert details["speculation"]["prediction_tokens"] == 30


def spec_stats() -> EngineStats:
    return EngineStats(generation_tokens=180, committed_draws=100, spec_verify_draws=40,
                       spec_proposed=Counter(tree=60, prediction=50), spec_accepted=Counter(tree=30, prediction=45))


def test_metrics_list_every_draft_source_from_the_start() -> None:
    off = scrape(EngineStats())
    for fam in ("radixserve_spec_proposed_tokens_total", "radixserve_spec_accepted_tokens_total"):
        assert {k for k in off if k.startswith(fam + "{")} == {f"{fam}{{source={s}}}" for s in DRAFT_SOURCES}
        assert all(off[f"{fam}{{source={s}}}"] == 0 for s in DRAFT_SOURCES)
    assert off["radixserve_spec_verify_draws_total"] == 0 and off["radixserve_committed_draws_total"] == 0
    assert off["radixserve_tokens_per_step"] == 0
    on = scrape(spec_stats())
    assert on.keys() == off.keys()
    assert on["radixserve_spec_proposed_tokens_total{source=tree}"] == 60
    assert on["radixserve_spec_proposed_tokens_total{source=prediction}"] == 50
    assert on["radixserve_spec_proposed_tokens_total{source=lookup}"] == 0
    assert on["radixserve_spec_accepted_tokens_total{source=tree}"] == 30
    assert on["radixserve_spec_accepted_tokens_total{source=prediction}"] == 45
    assert on["radixserve_spec_verify_draws_total"] == 40 and on["radixserve_committed_draws_total"] == 100
    assert on["radixserve_tokens_per_step"] == 1.8


def test_cache_stats_have_the_speculation_figures() -> None:
    off = cache_stats_json(EngineStats(), 16, 0, [])["speculation"]
    assert off == {"proposed": 0, "accepted": 0, "acceptance": 0.0, "verify_draws": 0, "committed_draws": 0,
                   "tokens_per_step": 0.0, "by_source": {s: {"proposed": 0, "accepted": 0, "acceptance": 0.0}
                                                         for s in DRAFT_SOURCES}}
    on = cache_stats_json(spec_stats(), 16, 0, [])["speculation"]
    assert (on["proposed"], on["accepted"], on["acceptance"]) == (110, 75, 75 / 110)
    assert on["by_source"]["tree"] == {"proposed": 60, "accepted": 30, "acceptance": 0.5}
    assert on["by_source"]["prediction"] == {"proposed": 50, "accepted": 45, "acceptance": 0.9}
    assert on["by_source"]["lookup"]["proposed"] == 0
    assert (on["verify_draws"], on["committed_draws"], on["tokens_per_step"]) == (40, 100, 1.8)
