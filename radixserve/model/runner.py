"""Runs one scheduled batch through the model: the forward pass and logits for the sampling rows.
Before it, `apply_copies` runs the batch's block copies (copy-on-write, and moves between the
device pool and the host tier, `host_kv.HostKVCache`).

Both paths take their inputs from `batch_inputs.build_inputs` (token ids, positions, slots, pending
tokens). Decode-only batches take the padded static-buffer path (`decode_graphs.PaddedDecoder`: CUDA
graphs on CUDA with the Triton backend, the same padded path eagerly elsewhere); batches with
prefill chunks, and every batch under `enforce_eager`, are sent as fresh tensors and run eagerly.
Owns the model, the KV cache tensors, the attention backend and the hot-path ops; knows nothing of
scheduling. On CUDA it also sizes the KV pool from device memory (`memory.DeviceBudget`); on CPU it
sizes torch's threads (`cpu_threads`) and, unless `enforce_eager`, loads the C++ extension
(`cpu_extension`), whose kernel then runs the projections and LM head (`cpu_linear.BlockedLinear`)
and whose compiled step runs every step whose rows are all short (`cpu_step`); without it the
weights are packed for oneDNN (`cpu_linear.PackedLinear`) and every step runs the Python layers.
It counts the host seconds it spends building inputs (`build_time`) for the engine's step clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from radixserve.core import Batch, BlockCopy, CopyKind
from radixserve.kernels.cpu_extension import loaded_or_explained
from radixserve.kernels.cpu_linear import BlockedLinear, PackedLinear, pack_for_cpu, packing_works
from radixserve.kernels.ggml_quants import QuantizedEmbedding, QuantizedLinear
from radixserve.model.attention import AttentionMetadata, make_backend
from radixserve.model.batch_inputs import BuildTime, PendingInputs, build_inputs
from radixserve.model.causal_conv import CausalConv, RecurrentImplementation
from radixserve.model.cpu_step import CpuStep, compiled_cpu_step
from radixserve.model.cpu_threads import configure_cpu_threads
from radixserve.model.decode_graphs import PaddedDecoder, capture_sizes
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.device import resolve_device, resolve_dtype, to_device
from radixserve.model.host_kv import HostKVCache
from radixserve.model.kv_cache import KVCache, KVLayout, resolve_kv_dtype
from radixserve.model.loader import load_model
from radixserve.model.mamba2 import Mamba2Mixer
from radixserve.model.memory import DeviceBudget, in_use_bytes, peak_bytes
from radixserve.model.moe import MoE
from radixserve.model.ops import make_ops
from radixserve.model.spec import ModelSpec, WindowKVSpec, load_spec
from radixserve.model.state_cache import StateCache, StateLayout
from radixserve.model.window_view import WindowView, check_written_blocks_mapped

log = logging.getLogger(__name__)


_SLOT_SIDE = (CopyKind.STATE, CopyKind.WINDOW_BLOCK)  # copies in the state slots or window blocks
PROMPT_LOGPROB_SLICE = 256  # rows whose full-vocabulary logits exist at once (a 128k vocabulary: 128 MiB)


@dataclass
class RowLogprobs:
    """Logprobs asked at tokens of a step other than its sampling rows (prompt logprobs): at each of
    `rows` (indices into the step's T tokens), the logprob of `targets[i]` and the `top` most likely
    tokens. The forward fills `values` [R, 1 + top] (the target's, then the top's) and `ids` [R, top]
    on the device; they stay None when the forward did not run as one batch."""

    rows: list[int]
    targets: list[int]
    top: int
    values: torch.Tensor | None = None
    ids: torch.Tensor | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index into the T tokens of each row whose logits are sampled


def sliding_layout(sliding_window_kv: str, device: torch.device, spec: ModelSpec) -> str:
    """Where sliding-window layers keep their K/V (config.SLIDING_WINDOW_KV), resolved: "all", "window"
    or "window-blocks". "auto" is "window-blocks" where the model mixes sliding-window and full-attention
    layers and has no recurrent ones (their decode steps keep the padded path and its CUDA graphs); else
    "all" on CUDA where one paged pool holds every layer's head shape, since window states take a model
    off the padded decode path and its graphs (docs/hybrid_cache.md); else "window"."""
    if sliding_window_kv == "all" and spec.mixed_head_shapes:
        raise ValueError(f"--sliding-window-kv all: {spec.architecture}'s sliding-window and global layers have "
                         "different head shapes, which one paged pool cannot hold; use window or auto")
    groups = spec.with_window_group() is not spec and not spec.is_hybrid
    if sliding_window_kv == "window-blocks" and not groups:
        raise ValueError("--sliding-window-kv window-blocks needs a model with sliding-window and full-attention "
                         f"layers and no recurrent ones; {spec.architecture} has " +
                         ("recurrent layers" if spec.is_hybrid else "no such mix"))
    if sliding_window_kv == "auto":
        if groups:
            return "window-blocks"
        return "all" if device.type == "cuda" and not spec.mixed_head_shapes else "window"
    return sliding_window_kv


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str, device: str, backend: str, block_size: int,
                 load_format: str = "auto", enforce_eager: bool = False, cpu_threads: int | None = None,
                 kv_cache_dtype: str = "auto", quantized_activations: str = "int8",
                 sliding_window_kv: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":
            configure_cpu_threads(cpu_threads)
        # a GGUF keeps its quantized weights unless a dtype was asked for (then they are dequantized to
        # it) or every step is eager (no C++ kernel runs)
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, load_format,
                                           keep_quantized=dtype == "auto" and not enforce_eager,
                                           quantized_activations=quantized_activations,
                                           sliding_window_kv=sliding_layout(sliding_window_kv, self.device,
                                                                            load_spec(model_dir)))
        cpu_kernels = self.device.type == "cpu" and self._pack_for_cpu(enforce_eager)
        self.backend = make_backend(backend, self.device, cpu_kernel=cpu_kernels)
        # the recurrent layers follow the attention backend: Triton with Triton (CUDA, or the interpreter in
        # tests), the C++ scans where the extension runs, else torch
        scans: RecurrentImplementation = ("triton" if self.backend.name == "triton" else
                                          "cpp" if cpu_kernels else "torch")
        for module in self.model.modules():
            if isinstance(module, MoE):
                module.pack(use_cpu_kernel=cpu_kernels)
            elif isinstance(module, (GatedDeltaNet, Mamba2Mixer)):
                module.implementation = scans
            elif isinstance(module, CausalConv):  # no C++ convolution: torch beside the C++ scans
                module.implementation = "triton" if scans == "triton" else "torch"
        self.ops = make_ops(self.backend.name, cpu_kernels)
        if self.backend.name == "triton" and block_size < 16:  # tl.dot needs K >= 16 on NVIDIA GPUs
            raise ValueError(f"the triton attention backend needs block_size >= 16, got {block_size}")
        if (kv_cache_dtype == "fp8" and self.backend.name == "triton" and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError("--kv-cache-dtype fp8 in the Triton kernels needs e4m3 conversions, native from sm_89 (Ada, "
                             "Hopper) on: use --attention-backend torch on this GPU")
        # a GGUF file's quantized weights keep K/V in fp16, as llama.cpp does, unless asked otherwise
        self.kv_cache_dtype = resolve_kv_dtype(kv_cache_dtype, any(
            isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in self.model.modules()))
        self.block_size = block_size
        self.enforce_eager = enforce_eager
        self.kv_cache: KVCache | None = None
        self.host_cache: HostKVCache | None = None
        self.decoder: PaddedDecoder | None = None
        self.cpu_step: CpuStep | None = None  # the compiled CPU step (`allocate_kv_cache` makes it)
        self.build_time = BuildTime()  # host seconds building inputs, both paths (the engine's step clock reads it)

    def _pack_for_cpu(self, enforce_eager: bool) -> bool:
        """The CPU matmuls: the extension's kernel where it is built (not under `enforce_eager`),
        else oneDNN's layout where this machine's oneDNN runs it, else plain weights. Returns whether
        the extension is loaded (its attention kernel then runs too). A GGUF's quantized weights
        (`ggml_quants.QuantizedLinear`, a quantized embedding's head among them) stay as they are."""
        tied = self.model.model.embed_tokens.weight if self.model.lm_head is None else None
        extension = None if enforce_eager else loaded_or_explained()
        quantized = sum(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in self.model.modules())
        kept = f"; {quantized} quantized weights in their file's types" if quantized else ""
        if extension is not None and packing_works(self.dtype, BlockedLinear):
            log.info("CPU matmuls: %d full-precision weights in the C++ kernel's layout%s",
                     pack_for_cpu(self.model, tied, BlockedLinear), kept)
        elif packing_works(self.dtype, PackedLinear):
            log.info("CPU matmuls: %d full-precision weights packed for oneDNN%s",
                     pack_for_cpu(self.model, tied, PackedLinear), kept)
        return extension is not None

    @property
    def decodes_padded(self) -> bool:
        """Whether decode steps may take the padded path: every model, except one with recurrent layers
        off the Triton kernels (the torch and C++ scans read host lists of slots, which a graph cannot
        replay, and the C++ ones refuse the slot padding rows share; without a graph the padded path
        would only add padding rows) or with window states (their layers index the states by host lists
        too)."""
        if not self.spec.is_hybrid:
            return True
        scans = {m.implementation for m in self.model.modules() if isinstance(m, (GatedDeltaNet, Mamba2Mixer, CausalConv))}
        return scans == {"triton"} and not any(isinstance(r, WindowKVSpec) for r in self.spec.recurrents)

    @property
    def uses_cuda_graphs(self) -> bool:
        # the torch backend reads host copies of lengths inside its forward, which a graph cannot replay
        return (self.device.type == "cuda" and self.backend.name == "triton" and not self.enforce_eager
                and self.decodes_padded)

    def kv_layout(self) -> KVLayout:
        s = self.spec
        return KVLayout(len(s.paged_attentions), *s.paged_kv_shape, self.block_size, self.dtype, self.kv_cache_dtype)

    def state_layout(self) -> StateLayout | None:
        """A hybrid model's recurrent-state slot shape; None for a model of attention layers only."""
        return StateLayout(tuple(self.spec.recurrents), self.dtype) if self.spec.is_hybrid else None

    def window_layout(self) -> KVLayout | None:
        """The window group's block shape (`--sliding-window-kv window-blocks`): every sliding-window
        layer's K/V of a block, in the KV cache's dtype; None without a window group."""
        s = self.spec
        if not s.window_group_attentions:
            return None
        return KVLayout(len(s.window_group_attentions), *s.window_group_shape, self.block_size, self.dtype,
                        self.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int, host_blocks: int = 0, state_slots: int = 0,
                          window_blocks: int = 0) -> None:
        self.kv_cache = KVCache(self.kv_layout(), num_blocks, self.device)
        layout, windows = self.state_layout(), self.window_layout()
        if layout is not None:
            self.kv_cache.states = StateCache(layout, state_slots, self.device)
        if windows is not None:
            self.kv_cache.windows = KVCache(windows, window_blocks, self.device)
        self.host_cache = HostKVCache(self.kv_cache, host_blocks)
        if self.device.type == "cpu" and not self.enforce_eager:
            self.cpu_step = compiled_cpu_step(self.model, self.kv_cache, self.backend, self.ops)

    def apply_copies(self, copies: list[BlockCopy]) -> None:
        """Run a step's block copies, in order, queued ahead of its forward."""
        assert self.host_cache is not None and self.kv_cache is not None, "allocate_kv_cache first"
        with torch.inference_mode():
            states, windows = self.kv_cache.states, self.kv_cache.windows
            if states is not None or windows is not None:  # (no other model's steps have such copies)
                # slots, window blocks and KV blocks are separate storage: only each one's own order matters
                for c in copies:
                    if c.kind is CopyKind.STATE:
                        assert states is not None
                        states.copy_slots([c.src], [c.dst])
                    elif c.kind is CopyKind.WINDOW_BLOCK:
                        assert windows is not None
                        windows.copy_blocks([c.src], [c.dst])
                copies = [c for c in copies if c.kind not in _SLOT_SIDE]
            self.host_cache.apply(copies)

    def kv_blocks_for_device(self, utilization: float, max_step_tokens: int, max_batch: int) -> int:
        """CUDA: the KV blocks that fit in `utilization` of the device after weights, the activations
        of the largest step and (unless eager) the decode graphs, all measured before the pool exists."""
        layout = self.kv_layout()
        probe = KVCache(layout, 1, self.device)  # padding-style rows write only its scratch block
        windows = self.window_layout()
        if windows is not None:
            probe.windows = KVCache(windows, 1, self.device)
        activations = peak_bytes(partial(self._probe, probe, max_step_tokens, min(max_step_tokens, max_batch)), self.device)
        largest = capture_sizes(max_batch)[-1]
        graphs = peak_bytes(partial(self._probe, probe, largest, largest), self.device) if self.uses_cuda_graphs else 0
        del probe
        total, used = in_use_bytes(self.device)
        budget = DeviceBudget(total, used, activations, graphs, utilization)
        blocks = budget.kv_blocks(layout.bytes_per_block)
        log.info("KV pool: %d blocks (%d tokens, %.2f GiB) = %.2f of %.1f GiB minus weights/context %.2f GiB, "
                 "activations %.2f GiB, CUDA graphs %.2f GiB", blocks, blocks * self.block_size,
                 blocks * layout.bytes_per_block / 2**30, utilization, total / 2**30, used / 2**30,
                 activations / 2**30, graphs / 2**30)
        return blocks

    @torch.inference_mode()
    def _probe(self, cache: KVCache, tokens: int, sampled_rows: int) -> None:
        """One forward of `tokens` one-token rows on a scratch cache, with logits for `sampled_rows`."""
        dev, slot = self.device, cache.scratch_block * self.block_size
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), slot, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.arange(tokens + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(tokens, dtype=torch.int32, device=dev),
            block_table=torch.full((tokens, 1), cache.scratch_block, dtype=torch.int32, device=dev),
            query_lens=[1] * tokens, seq_lens_host=[1] * tokens,
        )
        if cache.windows is not None:  # both scratch blocks have the same index: the same view
            meta.window = replace(meta, plans={})
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        hidden = self.model(ids, ids, cache, meta, self.backend, self.ops)
        self.model.compute_logits(hidden[:sampled_rows])

    def prepare_decode(self, max_batch: int, max_seq_len: int) -> None:
        """Set up the padded decode path for batches up to `max_batch` (and capture its CUDA graphs)."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        if self.enforce_eager or not self.decodes_padded:
            return
        windows, states = self.kv_cache.windows, self.kv_cache.states
        self.decoder = PaddedDecoder(max_batch, max_seq_len, self.block_size, self.kv_cache.scratch_block,
                                     self.spec.vocab_size, self.device, self.build_time,
                                     window_scratch_block=None if windows is None else windows.scratch_block,
                                     scratch_slot=None if states is None else states.scratch_slot)
        if self.uses_cuda_graphs:
            with torch.inference_mode():
                self.decoder.capture(self._forward)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of every token (the padded decode path samples from every row)."""
        return self.model.compute_logits(self._hidden(input_ids, positions, meta))

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's final hidden states: from the compiled CPU step where it takes the step."""
        assert self.kv_cache is not None
        if self.cpu_step is not None:
            hidden = self.cpu_step.forward(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, self.kv_cache, meta, self.backend, self.ops)

    def prepare(self, batch: Batch, pending: PendingInputs | None = None) -> StepInputs:
        """The eager path's inputs: the batch's `build_inputs` lists as fresh device tensors."""
        started = time.perf_counter()
        try:
            return self._prepare(batch, pending)
        finally:
            self.build_time.seconds += time.perf_counter() - started

    def _prepare(self, batch: Batch, pending: PendingInputs | None) -> StepInputs:
        x = build_inputs(batch, self.block_size, pending)
        dev = self.device
        table = x.block_table_array()
        meta = AttentionMetadata(
            slot_mapping=to_device(x.slots, torch.long, dev),
            cu_seqlens_q=to_device(x.cu_seqlens, torch.int32, dev),
            seq_lens=to_device(x.seq_lens, torch.int32, dev),
            # numpy builds the [B, max blocks] rows several times faster than torch.tensor(list of lists)
            block_table=torch.from_numpy(table).to(dev, non_blocking=True),
            query_lens=x.query_lens,
            seq_lens_host=x.seq_lens,
            state_slots=x.state_slots,
        )
        windows = self.kv_cache.windows if self.kv_cache is not None else None
        if windows is not None:
            meta.window = self._window_view(meta, x.slots, table, batch.window_blocks, windows.scratch_block)
        input_ids = to_device(x.token_ids, torch.long, dev)
        if x.pending_at:
            assert pending is not None
            at, rows = to_device([x.pending_at, x.pending_rows], torch.long, dev)
            pending.gather_into(input_ids, at, rows)
        return StepInputs(
            input_ids=input_ids,
            positions=to_device(x.positions, torch.long, dev),
            meta=meta,
            sample_rows=to_device(x.sample_rows, torch.long, dev),
        )

    def _window_view(self, meta: AttentionMetadata, slots: list[int], table: np.ndarray, companions: dict[int, int],
                     scratch: int) -> AttentionMetadata:
        """The step as the window group sees it (model/window_view.py)."""
        assert self.kv_cache is not None
        check_written_blocks_mapped(slots, companions, self.block_size)
        rows, width = table.shape
        view = WindowView.allocate(self.kv_cache.num_blocks, scratch, len(slots), rows, width, self.device)
        view.fill(to_device(list(companions) + list(companions.values()), torch.long, self.device), meta.slot_mapping,
                  meta.block_table, self.block_size)
        return replace(meta, slot_mapping=view.slot_mapping, block_table=view.block_table, plans={})

    @torch.inference_mode()
    def run(self, batch: Batch, pending: PendingInputs | None = None, asked: RowLogprobs | None = None) -> torch.Tensor:
        """Logits [rows, vocab] (fp32) for the batch items whose chunk reaches their last token; valid
        until the next call (the padded decode path returns a view of its static logits buffer).
        Queued on the device without waiting for it; the batch's copies must have been applied
        (`apply_copies`). A last token that is PENDING_TOKEN is read from
        `pending`, the previous step's sampled ids on the device. `asked` (prompt logprobs) is filled
        in on the eager path, which a batch with asks always takes."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        if asked is None and self.decoder is not None and self.decoder.accepts(batch):
            return self.decoder.run(batch, self._forward, pending)
        inputs = self.prepare(batch, pending)
        hidden = self._hidden(inputs.input_ids, inputs.positions, inputs.meta)
        if asked is not None and asked.rows:
            self._row_logprobs(hidden, asked)
        if inputs.sample_rows.numel() == 0:
            return hidden.new_empty((0, self.spec.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def _row_logprobs(self, hidden: torch.Tensor, asked: RowLogprobs) -> None:
        """Fill `asked` from the hidden states, a slice of rows at a time: the full-vocabulary
        logits of a long prompt chunk are never all in memory at once."""
        dev = hidden.device
        rows, targets = to_device(asked.rows, torch.long, dev), to_device(asked.targets, torch.long, dev)
        values, ids = [], []
        for at in range(0, len(asked.rows), PROMPT_LOGPROB_SLICE):
            part = slice(at, at + PROMPT_LOGPROB_SLICE)
            lsm = torch.log_softmax(self.model.compute_logits(hidden[rows[part]]), dim=-1)
            top_values, top_ids = lsm.topk(asked.top, dim=-1) if asked.top else (lsm[:, :0], lsm[:, :0].long())
            values.append(torch.cat([lsm.gather(1, targets[part, None]), top_values], dim=1))
            ids.append(top_ids)
        asked.values, asked.ids = torch.cat(values), torch.cat(ids)

    def run_each(self, batch: Batch, pending: PendingInputs | None = None,
                 asked: RowLogprobs | None = None) -> list[torch.Tensor | None]:
        """Run each item of a batch on its own (after a batched forward failed): per item, its logits
        rows (0, or its `logit_rows`) or None where its own forward fails. The batch's copies already ran. `asked` is
        filled for the items that ran; the rows of an item that failed hold NaN."""
        out: list[torch.Tensor | None] = []
        parts: list[tuple[list[int], RowLogprobs]] = []
        start = 0
        for item in batch.items:
            end = start + item.num_tokens
            picks = [j for j, row in enumerate(asked.rows) if start <= row < end] if asked is not None else []
            sub = RowLogprobs([asked.rows[j] - start for j in picks], [asked.targets[j] for j in picks], asked.top) \
                if asked is not None and picks else None
            start = end
            try:
                # a copy: the padded path returns a view of a buffer the next item overwrites
                out.append(self.run(Batch([item], window_blocks=batch.window_blocks), pending, sub).clone())
                if sub is not None:
                    parts.append((picks, sub))
            except Exception:
                out.append(None)
        if asked is not None:
            asked.values = torch.full((len(asked.rows), 1 + asked.top), float("nan"), device=self.device)
            asked.ids = torch.zeros((len(asked.rows), asked.top), dtype=torch.long, device=self.device)
            for picks, sub in parts:
                assert sub.values is not None and sub.ids is not None  # its forward ran
                at = to_device(picks, torch.long, self.device)
                asked.values[at], asked.ids[at] = sub.values, sub.ids
        return out
