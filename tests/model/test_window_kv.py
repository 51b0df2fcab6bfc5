"""Sliding-window attention over window states (`model/window_kv.py`, `--sliding-window-kv window`)
against the dense reference of test_attention_variants: each row's slot holds the K/V rows of the
window - 1 tokens before its new ones (right-aligned, finite garbage where a short row has no such
token, which must be masked), every variant (sinks, softcap) and mix of decodes, verifications and
long prefill chunks; after the step each slot holds exactly its row's last window - 1 tokens. Also
the spec: which layers keep a window state and what the KV cache and the state cache then hold."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_variants import MIXES, SCALE, VARIANTS, WINDOW, Case, _case, _reference, _tolerance
from tiny_models import tiny_model_dir

from radixserve.model import window_kv
from radixserve.model.spec import WindowKVSpec, load_spec
from radixserve.model.state_cache import StateLayout
from radixserve.model.window_kv import window_attention

GARBAGE = 1e3  # where a slot has no token yet: finite (a real slot holds an earlier sequence's K/V)


def _slot_rows(case: Case, b: int, first: int, count: int) -> torch.Tensor:
    """Row b's K/V rows at positions first.. (count of them) as a window state stores them [count, 2 * Hkv * D]:
    garbage at negative positions."""
    rows = torch.full((count, 2 * case.keys[b][0].numel()), GARBAGE, dtype=torch.float64)
    for r in range(count):
        if first + r >= 0:
            rows[r] = torch.cat([case.keys[b][first + r].reshape(-1), case.values[b][first + r].reshape(-1)])
    return rows


def _windows(case: Case, dtype: torch.dtype) -> torch.Tensor:
    """A state tensor with one slot per row (and a scratch slot), each holding its window before the step."""
    states = torch.zeros(len(case.rows) + 1, WINDOW - 1, 2 * case.keys[0][0].numel(), dtype=dtype)
    for b, (n, new) in enumerate(case.rows):
        states[b] = _slot_rows(case, b, n - new - WINDOW + 1, WINDOW - 1).to(dtype)
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if "window" in v] + ["window+sinks", "window+softcap"])
def test_window_states_are_the_dense_reference(variant: str, mix: str, dtype: torch.dtype) -> None:
    args: dict[str, Any] = {"window": WINDOW, **{k: v for k, v in VARIANTS["window+sinks+softcap"].items()
                                                 if k in variant}}
    case = _case(MIXES[mix], dtype, seed=len(variant) + len(mix), window=WINDOW)
    windows = _windows(case, dtype)
    meta = case.meta()
    meta.state_slots = list(range(len(case.rows)))
    got = window_attention(case.q, case.k_new, case.v_new, windows, meta, SCALE, WINDOW, args.get("sinks"),
                           args.get("softcap"))
    assert got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got.double(), _reference(case, **args), **_tolerance(dtype))
    for b, (n, _) in enumerate(case.rows):  # each slot moved on to its row's last window - 1 tokens
        torch.testing.assert_close(windows[b].double(), _slot_rows(case, b, n - WINDOW + 1, WINDOW - 1).to(dtype).double())
    assert (windows[-1] == 0).all(), "the scratch slot is no row's"


def test_a_long_chunk_in_pieces_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    args = VARIANTS["window+sinks+softcap"]
    case = _case([(700, 520), (30, 20), (5, 1)], torch.float32, seed=4, window=WINDOW)
    monkeypatch.setattr(window_kv, "WINDOW_PIECE", 30)
    windows = _windows(case, torch.float32)
    meta = case.meta()
    meta.state_slots = list(range(len(case.rows)))
    got = window_attention(case.q, case.k_new, case.v_new, windows, meta, SCALE, WINDOW, args["sinks"],
                           args["softcap"])
    torch.testing.assert_close(got.double(), _reference(case, **args), **_tolerance(torch.float32))


def test_a_probe_forward_without_states_starts_every_row_from_an_empty_window() -> None:
    case = _case([(1, 1), (1, 1), (30, 30)], torch.float32, seed=6, window=WINDOW)
    got = window_attention(case.q, case.k_new, case.v_new, None, case.meta(), SCALE, WINDOW, None, None)
    torch.testing.assert_close(got.double(), _reference(case, window=WINDOW), **_tolerance(torch.float32))


def test_the_spec_keeps_window_layers_as_states_where_a_full_layer_remains() -> None:
    gemma3 = load_spec(tiny_model_dir("gemma3"))  # sliding, sliding, full
    assert not gemma3.is_hybrid and len(gemma3.paged_attentions) == 3
    windowed = gemma3.with_window_states()
    assert windowed.is_hybrid and len(windowed.paged_attentions) == 1
    assert windowed.recurrents == [WindowKVSpec(8, windowed.kv_size)] * 2
    assert [windowed.kv_index(i) for i in range(3)] == [0, 0, 0] and windowed.state_index(2) == 2
    layout = StateLayout(tuple(windowed.recurrents), torch.float32)
    assert layout.bytes_per_slot == 2 * 7 * 2 * windowed.kv_size * 4  # two layers' last 7 tokens' K and V
    # a model windowed on every layer (Mistral v0.1) keeps paged blocks: the radix tree needs one paged layer
    mistral = load_spec(tiny_model_dir("mistral"))
    assert all(a.window for a in mistral.attentions) and mistral.with_window_states() is mistral
    llama = load_spec(tiny_model_dir("llama"))
    assert llama.with_window_states() is llama and llama.with_window_group() is llama
    # window blocks: the window layers in a paged group of their own, no states
    grouped = gemma3.with_sliding_window_kv("window-blocks")
    assert not grouped.is_hybrid and len(grouped.paged_attentions) == 1 and len(grouped.window_group_attentions) == 2
    assert [grouped.kv_index(2), grouped.window_index(0), grouped.window_index(1)] == [0, 0, 1]
    assert grouped.window_group_shape == grouped.paged_kv_shape and not grouped.llama_shaped
    assert gemma3.with_sliding_window_kv("all") is gemma3


def test_a_llama_shaped_model_with_window_states_leaves_the_compiled_cpu_step() -> None:
    """The compiled step reads every layer's K/V from the paged cache: a Qwen2 with a sliding layer runs
    it with the layer paged, and the Python layers with the layer's window as a state."""
    from transformers import AutoConfig

    from radixserve.model.spec import ModelSpec

    config = AutoConfig.for_model("qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  use_sliding_window=True, sliding_window=8,
                                  layer_types=["full_attention", "sliding_attention"])
    spec = ModelSpec.from_hf_config(config)
    assert [a.window for a in spec.attentions] == [None, 8] and spec.llama_shaped
    assert not spec.with_window_states().llama_shaped


def test_auto_pages_windows_in_their_group_and_keeps_window_states_off_cuda() -> None:
    """"auto" pages the sliding layers' K/V in the window group wherever a model mixes sliding and full
    layers (its decode steps keep the padded path and CUDA graphs); a model windowed everywhere keeps its
    windows as states, except on CUDA, where states would give up the decode graphs and the windows are
    paged with every token's K/V."""
    from radixserve.model.runner import sliding_layout

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    uniform, mixed = load_spec(tiny_model_dir("gemma3")), load_spec(tiny_model_dir("gemma4"))
    assert not uniform.mixed_head_shapes and mixed.mixed_head_shapes
    assert sliding_layout("auto", cpu, uniform) == "window-blocks" and sliding_layout("auto", cuda, uniform) == "window-blocks"
    assert sliding_layout("window", cuda, uniform) == "window" and sliding_layout("all", cpu, uniform) == "all"
    assert sliding_layout("auto", cuda, mixed) == sliding_layout("window-blocks", cuda, mixed) == "window-blocks"
    mistral = load_spec(tiny_model_dir("mistral"))  # windowed everywhere: no group, its windows as states
    assert sliding_layout("auto", cpu, mistral) == "window" and sliding_layout("auto", cuda, mistral) == "all"
    with pytest.raises(ValueError, match="has no such mix"):
        sliding_layout("window-blocks", cpu, mistral)
    with pytest.raises(ValueError, match="different head shapes"):
        sliding_layout("all", cpu, mixed)
    with pytest.raises(ValueError, match="one pool holds one shape"):
        _ = mixed.paged_kv_shape
    assert mixed.with_window_states().paged_kv_shape == (1, 32)
    grouped = mixed.with_window_group()  # the global layers paged, the sliding ones in their group: one shape each
    assert grouped.paged_kv_shape == (1, 32) and grouped.window_group_shape != grouped.paged_kv_shape
