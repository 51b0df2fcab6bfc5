"""Every model family, served: `radixserve bench random-checkpoint --family NAME` writes a tiny
checkpoint (its own code path, `write_family_checkpoint`, with the family's chat template and a
tokenizer trained on the spot), a server on 127.0.0.1 serves it with speculative decoding on, and the
official clients call every API once: OpenAI chat completions (streamed and not), completions and
responses, Anthropic messages, and the sessions API (two turns). So are tiny GGUF files (`tiny_gguf.py`)
of the layouts the GGUF loader undoes, served as shipped.

The server is configured by `radixserve serve`'s own parser from the same flags. Four families, one of
each unusual chat format (Gemma 3's folded system prompt, gpt-oss's harmony, GLM-4's turns without an
end marker, Qwen3-MoE's thinking), are served by a real `radixserve serve --model DIR` process; the
others by the same app in this process (`BackgroundServer`): a process takes about 12 s to import,
start and stop on a 2-core machine, so sixteen made this file take 4.5 minutes, against about 1 now.

The replies are random text; what is checked is their shape and accounting: each reply is well formed,
usage adds up (prompt + completion = total, at most max_tokens generated, Anthropic's input figures
add up to count_tokens, a session's second prompt holds its first turn), a streamed greedy reply is
the non-streamed one, and a repeated request reads its prompt from the cache and its reply from the
radix tree's drafts. Every server is stopped (a process: SIGINT, then SIGKILL) whatever happens, and no
process started while it ran outlives the test.

Also here: the command's own invariants (every architecture radixserve runs has a family shape and a
chat format; the real shapes fit a budget by cutting layers, then experts).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixserve.model.families import FAMILIES
from radixserve.server.owners import OWNER_HEADER
from radixserve_bench.checks.random_checkpoint import fit_to_budget, pattern_layers, weight_bytes, write_family_checkpoint
from radixserve_bench.family_templates import FORMAT_OF_FAMILY
from radixserve_bench.step_shapes import FAMILY_SHAPES

pytest.register_assert_rewrite("server_testkit")
from server_testkit import leaves_no_process, pump_lines  # noqa: E402
from tiny_gguf import TinyGGUF, write_gemma4_gguf, write_tiny_gguf  # noqa: E402

STARTUP_S = 120.0
MAX_TOKENS = 8
SYSTEM = "You are a terse assistant. Answer in one short sentence."
USER = "What is the weather like in Paris today?"
# the serve flags: speculation on, a small KV pool (fast to allocate), a short shutdown
SERVE_FLAGS = ["--port", "0", "--no-web", "--speculation", "on", "--num-speculative-tokens", "4",
               "--kv-cache-memory-mb", "32", "--shutdown-grace", "0.5"]
_URL = re.compile(r"OpenAI API at (http://\S+)/v1")


IN_A_PROCESS = {"gemma3", "gpt-oss", "glm4", "qwen3-moe"}  # served by a `radixserve serve` process


@contextmanager
def serving(model: Path, process: bool) -> Iterator[str]:
    """A server of `model` configured by `radixserve serve`'s parser from SERVE_FLAGS, in a process of its
    own or in this one: its base URL; stopped on the way out."""
    if process:
        with serve_process(model) as url:
            yield url
        return
    from radixserve import AsyncEngine
    from radixserve.cli import build_parser, engine_config_from_args
    from radixserve.server import BackgroundServer
    from radixserve.server.cli import server_config_from_args

    args = build_parser().parse_args(["serve", "--model", str(model), *SERVE_FLAGS])
    engine_config = engine_config_from_args(args)
    assert engine_config.num_speculative_tokens == 4
    with BackgroundServer(lambda: AsyncEngine(engine_config), server_config_from_args(args)) as srv:
        yield srv.url


@contextmanager
def serve_process(model: Path) -> Iterator[str]:
    """A `radixserve serve` process over `model`: its base URL; stopped on the way out."""
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(model), *SERVE_FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=pump_lines, args=(proc, lines), daemon=True).start()
    log: list[str] = []
    try:
        yield _serving_url(proc, lines, log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _serving_url(proc: subprocess.Popen[str], lines: queue.Queue[str], log: list[str]) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{''.join(log)}"
            continue
        log.append(line)
        if found := _URL.search(line):
            return found.group(1)
    raise AssertionError(f"serve did not start in {STARTUP_S:.0f} s:\n{''.join(log)}")


def _hybrid(model: Path) -> bool:
    """Whether the served model keeps fixed-size states (recurrent layers; sliding-window layers beside
    full ones go to the window group under the default --sliding-window-kv auto): no speculation, hits
    only at checkpoints."""
    from radixserve.model.spec import load_spec

    return load_spec(model).is_hybrid


def _speculation(usage: Any) -> dict[str, Any]:
    return dict(usage.model_dump()["completion_tokens_details"]["speculation"])


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def _check_chat(client: openai.OpenAI, model: str, hybrid: bool = False) -> None:
    """`hybrid`: a model with recurrent layers resumes a prompt only from a state checkpoint, which the
    first repeat takes where the prompt leaves the cached reply (docs/hybrid_cache.md); it does not draft."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    kw: dict[str, Any] = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    first = client.chat.completions.create(**kw)
    choice, u = first.choices[0], first.usage
    assert first.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and u is not None
    assert 1 <= u.completion_tokens <= MAX_TOKENS and u.prompt_tokens + u.completion_tokens == u.total_tokens
    text, thought = choice.message.content or "", _extra(choice.message, "reasoning_content") or ""
    assert isinstance(text, str) and isinstance(thought, str)
    details = u.completion_tokens_details
    assert details is not None and 0 <= (details.reasoning_tokens or 0) <= u.completion_tokens

    if hybrid:
        client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)  # the same prompt: read from the cache, the reply drafted
    assert again.usage is not None and again.usage.prompt_tokens == u.prompt_tokens
    assert again.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details.cached_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < u.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy
    if u.completion_tokens > 2 and not hybrid:  # a longer reply than that is the tree's to draft
        assert _speculation(again.usage)["accepted"] > 0, _speculation(again.usage)

    pieces, thoughts, usage, finish = [], [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            thoughts.append(_extra(c.delta, "reasoning_content") or "")
            finish = c.finish_reason or finish
    assert usage is not None and usage.completion_tokens == u.completion_tokens
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    assert ("".join(pieces), "".join(thoughts), finish) == (text, thought, choice.finish_reason)


def _check_completions(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="The weather in Paris is", max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage is not None
    assert 1 <= r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.prompt_tokens + r.usage.completion_tokens == r.usage.total_tokens


def _check_responses(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, instructions=SYSTEM, input=USER, max_output_tokens=MAX_TOKENS,
                                temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.usage is not None
    assert 1 <= r.usage.output_tokens <= MAX_TOKENS
    assert r.usage.input_tokens + r.usage.output_tokens == r.usage.total_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat requests' prompt, rendered the same


def _check_messages(client: anthropic.Anthropic, model: str) -> None:
    ask: list[Any] = [{"role": "user", "content": USER}]
    r = client.messages.create(model=model, system=SYSTEM, messages=ask, max_tokens=MAX_TOKENS,
                               extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type in ("text", "thinking") for b in r.content)
    u = r.usage
    assert 1 <= u.output_tokens <= MAX_TOKENS
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=ask).input_tokens
    assert u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0) == counted
    assert (u.cache_read_input_tokens or 0) > 0  # the chat requests' prompt


def _check_session(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        created = http.post("/v1/sessions", json={"system_prompt": SYSTEM,
                                                  "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0}})
        assert created.status_code == 201, created.text
        sid, owner = created.json()["id"], {OWNER_HEADER: created.json()["owner"]}
        turns = []
        for content in (USER, "And tomorrow?"):
            r = http.post(f"/v1/sessions/{sid}/messages", json={"content": content}, headers=owner)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["session_id"] == sid and body["message"]["role"] == "assistant"
            assert isinstance(body["message"]["content"], str) and body["finish_reason"] in ("stop", "length")
            assert 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS
            turns.append(body["usage"])
        first, second = turns
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
        assert second["cached_tokens"] >= first["prompt_tokens"] // 2  # the first turn, from the cache
        session = http.get(f"/v1/sessions/{sid}", headers=owner).json()
        assert session["system_prompt"] == SYSTEM
        assert [m["role"] for m in session["messages"]] == ["user", "assistant", "user", "assistant"]
        assert session["num_tokens"] >= second["prompt_tokens"] + second["completion_tokens"]
        assert http.delete(f"/v1/sessions/{sid}", headers=owner).status_code == 204


def _check_written(family: str, path: Path) -> None:
    """The checkpoint's eos ids are its template's stop tokens, every marker is one token, the embedding
    covers the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer, fmt = AutoTokenizer.from_pretrained(path, local_files_only=True), FORMAT_OF_FAMILY[family]
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    stop = [tokenizer.convert_tokens_to_ids(t) for t in fmt.stop]
    assert config["eos_token_id"] == generation["eos_token_id"] == stop
    assert config["architectures"] == FAMILY_SHAPES[family].config["architectures"]
    assert config["vocab_size"] == len(tokenizer)
    for i, token in enumerate(fmt.control):
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [i], token
        assert token in tokenizer.all_special_tokens, token


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_family_serves_every_api(family: str, tmp_path: Path) -> None:
    model = write_family_checkpoint(family, "tiny", tmp_path / family).path
    _check_written(family, model)
    with leaves_no_process(timeout_s=30) as started, serving(model, family in IN_A_PROCESS) as url:
        if family in IN_A_PROCESS:
            assert started(), "no serve process"
        _check_every_api(url, model)


def _check_every_api(url: str, model: Path) -> str:
    """Each API once with the official clients (the module docstring says what is checked); the name served."""
    name = str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        _check_chat(oai, name, hybrid=_hybrid(model))
        _check_completions(oai, name)
        _check_responses(oai, name)
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as claude:
        _check_messages(claude, name)
    _check_session(url)
    return name


# GGUF files served as shipped (quantized, in the C++ kernels), one of each layout the loader undoes:
# Phi-3's fused projections and LongRoPE, Qwen3.5's hybrid with its tiled value heads, Gemma 4's per-layer
# shapes, shared K/V and per-layer inputs (its sliding layers in the window group) with its own `gemma4` tokenizer and turns
GGUF_FILES = {"phi3": TinyGGUF("phi3", types={"attn_qkv": "Q4_K", "ffn_up": "Q4_1"}, rotary_dims=32,
                               longrope=([1.0 + 0.25 * i for i in range(16)], [1.0] * 16, 256, 1.2)),
              "qwen35": TinyGGUF("qwen35", types={"attn_qkv": "Q4_K", "ssm_alpha": "F32", "ssm_beta": "F32"},
                                 tied=False)}
GEMMA4_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q8_0", "ffn_gate": "Q5_0",
                "ffn_up": "Q5_1", "ffn_down": "Q4_0", "per_layer_token_embd": "Q8_0", "token_embd": "Q8_0"}


@pytest.mark.parametrize("arch", sorted([*GGUF_FILES, "gemma4"]))
def test_a_gguf_file_serves_every_api(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.model import gguf_checkpoint

    monkeypatch.setattr(gguf_checkpoint, "cache_root", lambda: tmp_path / "cache")  # its converted tokenizer
    path = tmp_path / f"tiny-{arch}.gguf"
    if arch == "gemma4":
        write_gemma4_gguf(path, GEMMA4_TYPES, seed=1)
    else:
        write_tiny_gguf(path, GGUF_FILES[arch])
    with leaves_no_process(timeout_s=30), serving(path, process=False) as url:
        assert _check_every_api(url, path) == f"tiny-{arch}"  # served under the file's stem


# -- the command's own invariants -----------------------------------------------------------


def test_every_architecture_has_a_family_shape_and_chat_format() -> None:
    """A multimodal architecture's text model is its text family's (tests/model/test_model.py loads it)."""
    shaped = {shape.config["architectures"][0] for shape in FAMILY_SHAPES.values()}
    text_models = {name: name.replace("ForConditionalGeneration", "ForCausalLM") for name, family in FAMILIES.items()
                   if family.multimodal}
    assert shaped == set(FAMILIES) - set(text_models) and set(text_models.values()) <= shaped
    assert set(FORMAT_OF_FAMILY) == set(FAMILY_SHAPES)
    for fmt in FORMAT_OF_FAMILY.values():  # tools reach these templates as contents (chat/template.py)
        assert "tools" not in fmt.template
    for family, shape in FAMILY_SHAPES.items():
        assert FAMILIES[shape.config["architectures"][0]].model_type == shape.model_type, family


def test_real_shapes_are_cut_to_the_budget_layers_first_then_experts() -> None:
    from transformers import AutoConfig

    gemma3 = FAMILY_SHAPES["gemma3"]
    full = AutoConfig.for_model(gemma3.model_type, **gemma3.config)
    assert pattern_layers(full) == 6  # five sliding layers, then a full one
    config, cuts = fit_to_budget(gemma3.model_type, dict(gemma3.config), weight_bytes(full) - 1)
    assert config.num_hidden_layers < full.num_hidden_layers and len(cuts) == 1
    assert config.layer_types == full.layer_types[:config.num_hidden_layers] and weight_bytes(config) < weight_bytes(full)
    assert (config.hidden_size, config.head_dim, config.vocab_size) == (1152, 256, 262144)

    mixtral = FAMILY_SHAPES["mixtral"]
    one_layer = fit_to_budget(mixtral.model_type, dict(mixtral.config), int(2e9))
    config, cuts = one_layer
    assert config.num_hidden_layers == 1 and 2 <= config.num_local_experts < 8 and "num_local_experts" in cuts[0]
    assert weight_bytes(config) <= 2e9 < weight_bytes(AutoConfig.for_model(mixtral.model_type, **{
        **mixtral.config, "num_hidden_layers": 1, "num_local_experts": config.num_local_experts + 1}))
    with pytest.raises(ValueError, match="over --max-gb"):
        fit_to_budget(mixtral.model_type, dict(mixtral.config), int(0.5e9))

    # Gemma 4: the share of layers reading earlier layers' K/V is kept, after one of each kind that projects it
    gemma4 = FAMILY_SHAPES["gemma-4"]
    config, cuts = fit_to_budget(gemma4.model_type, dict(gemma4.config), int(4e9))
    assert config.num_hidden_layers < 35 and len(cuts) == 1
    assert config.num_kv_shared_layers == 20 * config.num_hidden_layers // 35
    unshared = config.layer_types[:config.num_hidden_layers - config.num_kv_shared_layers]
    assert set(unshared) == {"sliding_attention", "full_attention"}


def test_a_family_shape_may_leave_its_vocabulary_to_the_config_class(tmp_path: Path) -> None:
    """Granite 4's shape names no vocab_size (it takes the config class's defaults): a copied tokenizer
    still sizes the embedding, from the class's default."""
    from tiny_models import tiny_chat_model_dir
    from transformers import AutoConfig

    shape = FAMILY_SHAPES["granite-4"]
    assert "vocab_size" not in shape.config
    written = write_family_checkpoint("granite-4", "tiny", tmp_path / "g4", tokenizer_dir=tiny_chat_model_dir())
    default = AutoConfig.for_model(shape.model_type).vocab_size
    assert json.loads((tmp_path / "g4" / "config.json").read_text())["vocab_size"] == default
    assert "copied from" in written.tokenizer
