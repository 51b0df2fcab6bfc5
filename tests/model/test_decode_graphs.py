"""The padded decode path (CUDA graphs on GPU, the same static buffers eagerly on CPU), the KV pool
sizing rule and the dummy load format, on CPU.

The padded path must be invisible: greedy tokens equal the unpadded eager path and transformers
(tests/engine/test_engine.py runs both paths), and padding rows must never write a block the pool owns.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tiny_models import tiny_model_dir

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.decode_graphs import bucket_for, capture_sizes
from radixserve.model.memory import DeviceBudget
from radixserve.model.window_view import WindowView, check_written_blocks_mapped

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_capture_sizes_cover_every_batch_with_little_padding() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    for batch in range(1, 257):
        size = bucket_for(batch, sizes)
        assert size is not None and batch <= size and size - batch < max(16, batch)
        assert size - batch <= 15
    assert bucket_for(257, sizes) is None


# these tests are about the padded path itself, which the suite's RADIXSERVE_TEST_EAGER=1 run turns off
about_the_padded_path = pytest.mark.skipif(os.environ.get("RADIXSERVE_TEST_EAGER") == "1",
                                           reason="RADIXSERVE_TEST_EAGER=1 turns the padded path off")


def _engine(**kw) -> LLMEngine:
    cfg = {"model": str(tiny_model_dir("llama")), "block_size": 16, "num_blocks": 64,
           "max_num_batched_tokens": 128, "max_num_seqs": 8} | kw
    return LLMEngine(EngineConfig(**cfg))


@about_the_padded_path
def test_padding_rows_never_write_a_live_block() -> None:
    engine = _engine()
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.graphs == {}  # CPU: the padded path runs without capture
    g = torch.Generator().manual_seed(0)
    for n in (21, 16, 40):  # three live sequences -> padded to 4 rows
        engine.add_request(torch.randint(4, 500, (n,), generator=g).tolist(), GREEDY)
    while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    running = list(engine.scheduler.running)
    assert len(running) == 3 and bucket_for(3, decoder.sizes) == 4
    kv = engine.runner.kv_cache
    assert kv is not None
    bs = engine.config.block_size
    newest = {s.seq_id: len(s.token_ids) - 1 for s in running}  # the position each one writes this step
    scratch = kv.scratch_block
    kv.data[:, :, scratch] = float("nan")  # padding must overwrite this, and nothing may read it into a live row
    before = kv.data.clone()
    engine.step()
    written = {s.block_table[newest[s.seq_id] // bs] * bs + newest[s.seq_id] % bs for s in running}
    flat_before = before.flatten(2, 3)  # [layers, 2, slots, heads, dim]
    flat_after = kv.data.flatten(2, 3)
    changed = (flat_before != flat_after) & ~(flat_before.isnan() & flat_after.isnan())
    changed_slots = set(changed.flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist())
    live_changed = {s for s in changed_slots if s // bs != scratch}
    assert live_changed == written, "a padded step wrote a slot of a live block it did not own"
    assert scratch * bs in changed_slots, "the padding row did not write its scratch slot"
    assert not any(o.finished and o.outputs[0].finish_reason == "error" for o in engine.step())
    engine.check_integrity()


def test_the_window_view_maps_each_kv_block_through_the_step_map_and_the_rest_to_scratch() -> None:
    kv_blocks, window_scratch, bs = 40, 9, 4
    g = torch.Generator().manual_seed(3)
    view = WindowView.allocate(kv_blocks, window_scratch, max_tokens=6, max_rows=4, max_blocks=5,
                               device=torch.device("cpu"))
    for step in range(3):  # each step starts from a fresh lookup: no entry of an earlier map survives
        mapped = torch.randperm(kv_blocks, generator=g)[:7].tolist()
        companions = dict(zip(mapped, torch.randperm(window_scratch, generator=g)[:7].tolist()))
        table = torch.randint(0, kv_blocks + 1, (3, 5), generator=g, dtype=torch.int32)
        table[2] = kv_blocks  # a padding row: the KV cache's scratch row
        slots = torch.tensor([mapped[0] * bs + 1, mapped[step + 1] * bs + 3, kv_blocks * bs])
        view.fill(torch.tensor(list(companions) + list(companions.values())), slots, table, bs)
        want = [[companions.get(b, window_scratch) for b in row] for row in table.tolist()]
        assert view.block_table[:3].tolist() == want
        assert view.slot_mapping[:3].tolist() == [companions[mapped[0]] * bs + 1, companions[mapped[step + 1]] * bs + 3,
                                                  window_scratch * bs]
    check_written_blocks_mapped([8, 9, 21], {2: 0, 5: 1}, bs)
    with pytest.raises(RuntimeError, match=r"writes KV blocks \[3\] that have no window block"):
        check_written_blocks_mapped([8, 13], {2: 0}, bs)


@about_the_padded_path
def test_window_blocks_take_the_padded_path_whose_padding_writes_only_the_scratch_blocks() -> None:
    """--sliding-window-kv window-blocks: decode steps run the padded path (CUDA graphs on GPU) with the
    window view in static buffers; the same tokens as every step eager, and a padded step writes the
    window pool only at its rows' own slots and the group's scratch block."""
    prompts = [torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 16, 40)]
    kw = {"model": str(tiny_model_dir("gemma3")), "sliding_window_kv": "window-blocks", "block_size": 4,
          "num_blocks": 96, "max_num_seqs": 8}
    eager = LLM(**kw, enforce_eager=True).generate(prompts, GREEDY)
    engine = LLM(**kw).engine
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.window is not None
    for i, p in enumerate(prompts):  # three live sequences -> padded to 4 rows
        engine.add_request(p, GREEDY, request_id=str(i))
    outs: dict[str, list[int]] = {}

    def step() -> None:  # each output carries its request's new tokens
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)

    while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        step()
    running = list(engine.scheduler.running)
    assert len(running) == 3 and bucket_for(3, decoder.sizes) == 4
    kv, cache, bs = engine.runner.kv_cache, engine.cache, engine.config.block_size
    assert kv is not None and kv.windows is not None and cache.windows is not None
    windows = kv.windows
    newest = {s.seq_id: len(s.token_ids) - 1 for s in running}  # the position each one writes this step
    windows.data[:, :, windows.scratch_block] = float("nan")
    before = windows.data.clone()
    step()
    written = {cache.windows.companion[s.block_table[newest[s.seq_id] // bs]] * bs + newest[s.seq_id] % bs
               for s in running}
    flat_before, flat_after = before.flatten(2, 3), windows.data.flatten(2, 3)
    changed = (flat_before != flat_after) & ~(flat_before.isnan() & flat_after.isnan())
    changed_slots = set(changed.flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist())
    assert {s for s in changed_slots if s // bs != windows.scratch_block} == written
    assert windows.scratch_block * bs in changed_slots, "the padding row did not write the window scratch slot"
    for _ in range(100):
        if not engine.has_unfinished():
            break
        step()
    assert [outs[k] for k in sorted(outs, key=int)] == [o.outputs[0].token_ids for o in eager]
    engine.check_integrity()


@about_the_padded_path
@pytest.mark.parametrize("eager", [False, True])
def test_padded_and_unpadded_paths_give_the_same_tokens(eager: bool) -> None:
    prompts = [torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 33, 50, 9)]
    padded = LLM(model=str(tiny_model_dir("qwen3")), num_blocks=96, max_num_seqs=8).generate(prompts, GREEDY)
    llm = LLM(model=str(tiny_model_dir("qwen3")), num_blocks=96, max_num_seqs=8, enforce_eager=eager)
    assert (llm.engine.runner.decoder is None) == eager
    other = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in padded] == [o.outputs[0].token_ids for o in other]


def test_device_budget_rule() -> None:
    gib = 2**30
    budget = DeviceBudget(total_bytes=80 * gib, in_use_bytes=17 * gib, activation_bytes=gib, graph_bytes=gib // 2,
                          utilization=0.9)
    assert budget.kv_bytes == int(72 * gib) - 17 * gib - gib - gib // 2
    assert budget.kv_blocks(2 * 2**20) == budget.kv_bytes // (2 * 2**20)
    tight = DeviceBudget(total_bytes=20 * gib, in_use_bytes=17 * gib, activation_bytes=gib, graph_bytes=0,
                         utilization=0.9)
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        tight.kv_blocks(2 * 2**20)


def test_dummy_load_format_needs_only_the_config(tmp_path) -> None:
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(tmp_path), num_blocks=16)
    llm = LLM(model=str(tmp_path), num_blocks=16, load_format="dummy")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    # on CPU the projections are packed for oneDNN (model/cpu_linear.py): read them back as plain tensors
    weights = [p.to_dense() if p.is_mkldnn else p for n, p in llm.engine.runner.model.named_parameters()
               if not n.endswith("norm.weight")]
    assert all(bool(p.isfinite().all()) and float(p.std()) > 0.01 for p in weights)


def test_engine_config_rejects_bad_memory_settings() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")
