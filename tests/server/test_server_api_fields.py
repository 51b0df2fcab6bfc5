"""The smaller pieces of the OpenAI surface, through the official `openai` client against a real server
on 127.0.0.1 (the tiny chat model): `models.retrieve`, `stream_options` only with `stream`, the seed's
stated range, and the sampling fields every API reads in one place (radixserve/sampling_fields.py)."""

from __future__ import annotations

import openai
import pytest

from radixserve.sampling_fields import SEED_RANGE, Api, SamplingFields
from radixserve.server import BackgroundServer
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.validation import ApiError

pytest_plugins = ["server_testkit"]

ASK = [{"role": "user", "content": "Hello"}]


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_retrieve_names_the_served_model_and_404s_any_other(tiny_chat_server: BackgroundServer) -> None:
    client = client_of(tiny_chat_server)
    name = tiny_chat_server.state.model_name
    model = client.models.retrieve(name)
    assert (model.id, model.object, model.owned_by) == (name, "model", "radixserve")
    assert model.model_extra is not None and model.model_extra["max_model_len"] == tiny_chat_server.engine.max_model_len
    assert [m.id for m in client.models.list()] == [name]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["param"] == "model" and "gpt-4o" in e.value.body["message"]  # type: ignore[index]


def test_stream_options_only_with_stream(tiny_chat_server: BackgroundServer) -> None:
    client = client_of(tiny_chat_server)
    model = tiny_chat_server.state.model_name
    for stream in (False, None):
        kwargs = {} if stream is None else {"stream": stream}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=2,  # type: ignore[call-overload]
                                           stream_options={"include_usage": True}, **kwargs)
        assert e.value.body["param"] == "stream_options"  # type: ignore[index]
    chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=2, stream=True,  # type: ignore[call-overload]
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_the_seed_range_is_a_signed_64_bit_integer(tiny_chat_server: BackgroundServer) -> None:
    client = client_of(tiny_chat_server)
    model = tiny_chat_server.state.model_name
    low, high = SEED_RANGE
    assert (low, high) == (-(2**63), 2**63 - 1)
    replies = [client.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=1.0, seed=seed)
               for seed in (low, high, high)]
    assert replies[1].choices[0].message.content == replies[2].choices[0].message.content
    for seed in (high + 1, low - 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=1, seed=seed)
        assert e.value.body["param"] == "seed"  # type: ignore[index]


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", [1]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("seed", 2**63), ("seed", 1.5), ("top_p", 0),
])
def test_each_sampling_field_is_checked_in_one_place(field: str, value: object) -> None:
    with pytest.raises(ApiError) as e:
        read_sampling({field: value}, Api.CHAT)
    assert e.value.param == field and e.value.status == 400


def test_read_sampling_normalises_what_it_accepts() -> None:
    got = read_sampling({"logit_bias": {"7": -100, "12": 5.5}, "presence_penalty": 0.5, "seed": -3, "stop": "x",
                         "temperature": None, "logit_bias_extra": 1}, Api.CHAT)
    assert got == SamplingFields(logit_bias={7: -100.0, 12: 5.5}, presence_penalty=0.5, seed=-3, stop=["x"])
    assert read_sampling({"logit_bias": {}}, Api.CHAT) == SamplingFields(), "an empty logit_bias is no bias"
