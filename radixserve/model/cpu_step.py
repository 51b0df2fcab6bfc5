"""The compiled CPU step: every decoder layer of a step whose rows are all short, in one C++ call.

On CPU a batch-1 decode step of the embedded model is about 120 oneDNN GEMVs and a thousand small
ops. From Python each small op costs several microseconds of interpreter and binding time, more than
its arithmetic. `csrc/cpu_step.cpp` runs the whole layer stack in one `radixserve::short_step` call:
the matmuls, attention, reductions and transcendentals as the same ATen operators, and the residual
add, the norm's scaling and rotary as plain loops with the same rounding, without changing a bit.

This module owns building that extension (once per torch version and source, with the system's C++
compiler, into the user cache beside the converted model; later starts load it in well under a
second) and deciding when a step may take it:
- the model's projections are packed for oneDNN (`cpu_linear`), the attention backend is torch's,
  the hot-path ops are `TorchOps`, the KV cache holds the model's dtype (not FP8), and the
  architecture has no q/k norm (Qwen3's);
- every row of the step has at most `SHORT_QUERY` new tokens (decodes, verifications of drafts).
Other steps, and every step under `--enforce-eager`, run the Python layers.

Invariant: both paths give the same hidden states and cache writes bit for bit, in fp32 and bf16
(tests/test_cpu_compiled_step.py checks with `torch.equal`), so a token's result does not depend on
which path its step took, and greedy output stays transformers' token for token.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixserve.model.attention import SHORT_QUERY, AttentionMetadata, TorchAttentionBackend
from radixserve.model.cpu_linear import MIN_ROWS, PackedLinear
from radixserve.model.embedded import cache_root
from radixserve.model.kv_cache import KVCache
from radixserve.model.kv_fp8 import is_packed
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.ops import ModelOps

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_step.cpp"
EXTENSION = "radixserve_cpu_step"


@dataclass(frozen=True)
class Extension:
    """The loaded extension: how long making it ready took, whether that included building it, and
    where it lives."""

    seconds: float
    built: bool
    directory: Path


def build_directory() -> Path:
    """One directory per source text and torch installation (version and place: the build names its
    headers' paths, so two environments sharing one directory would rebuild it turn by turn)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + str(Path(torch.__file__).parent).encode()).hexdigest()[:16]
    return cache_root() / "cpu_step" / f"torch-{torch.__version__}-{digest}"


@functools.cache
def load_extension() -> Extension:
    """Build (or reuse) and load the C++ step; raises when this machine cannot build it. Once per
    process: the operator namespace can be registered only once."""
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools, only needed on CPU

    started = time.perf_counter()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    with open(directory / "build.flock", "w") as held:
        # torch's own lock is a file that outlives a killed builder and then blocks every later
        # start; this one dies with its holder, and whoever holds it is the only one building, so
        # a torch lock file found under it is stale
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        # built from a copy inside the directory: its build file names the source's path, so
        # building from the checkout would rebuild whenever another checkout shares the directory
        source = directory / SOURCE.name
        if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
            shutil.copyfile(SOURCE, source)
        library = directory / f"{EXTENSION}.so"
        before = library.stat().st_mtime_ns if library.exists() else None
        cpp_extension.load(name=EXTENSION, sources=[str(source)], build_directory=str(directory),
                           extra_cflags=["-O2", "-ffp-contract=off"], is_python_module=False, verbose=False)
    return Extension(time.perf_counter() - started, library.stat().st_mtime_ns != before, directory)


def _put_ninja_on_path() -> None:
    # torch builds with the `ninja` executable from PATH; the pip package's copy sits in the virtual
    # environment's bin, which is not on PATH when `.venv/bin/radixserve` runs without activation
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def unsupported(model: LlamaForCausalLM, kv_cache: KVCache, backend: object, ops: ModelOps) -> str | None:
    """Why this model and cache cannot take the C++ step, or None when they can."""
    if kv_cache.data.device.type != "cpu":
        return "not on CPU"
    if not isinstance(backend, TorchAttentionBackend) or ops.name != "torch":
        return "the attention backend is not torch's"
    if is_packed(kv_cache.data):
        return "the KV cache is FP8"
    if model.spec.qk_norm:
        return "the model normalizes q and k"
    if not all(isinstance(m, PackedLinear) for layer in decoder_layers(model) for m in _linears(layer)):
        return "the weights are not packed for oneDNN"
    return None


def decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]


def _linears(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """A layer's projections in the C++ step's order: packed q/k/v, o, packed gate/up, down."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class CpuStep:
    """Runs a step of short rows through `radixserve::short_step`, holding what every call passes:
    the weights in layer order, each layer's cache, and the padding buffers of short batches."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: TorchAttentionBackend) -> None:
        spec = model.spec
        self.model, self.backend = model, backend
        self.block_size = kv_cache.layout.block_size
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in decoder_layers(model):
            packed = [m for m in _linears(layer) if isinstance(m, PackedLinear)]
            assert len(packed) == 4, "unsupported() first"
            qkv, o, gate_up, down = packed
            self.weights += [layer.input_layernorm.weight, qkv.weight, o.weight,
                             layer.post_attention_layernorm.weight, gate_up.weight, down.weight]
            self.biases += [m.bias for m in (qkv, o, gate_up, down)]
        self.k_caches = [kv_cache.k(i) for i in range(spec.num_layers)]
        self.v_caches = [kv_cache.v(i) for i in range(spec.num_layers)]
        dtype = model.model.embed_tokens.weight.dtype
        # a short batch's rows are padded into these (cpu_linear.MIN_ROWS): by input width
        self.pads = [torch.zeros(MIN_ROWS, width, dtype=dtype)
                     for width in (spec.hidden_size, spec.q_size, spec.intermediate_size)]
        self.heads = [spec.num_heads, spec.num_kv_heads, spec.head_dim]
        self.eps, self.scale = spec.rms_norm_eps, spec.head_dim**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden], as `LlamaForCausalLM.forward` returns them, or
        None when a row is too long for the short path (the caller runs the Python layers)."""
        if any(n > SHORT_QUERY for n in meta.query_lens):
            return None
        plan = self.backend.short_plan(meta, self.block_size, input_ids.device)
        assert plan is not None  # every row is short
        k_buffer, v_buffer = self.backend.short_buffers(plan, self.k_caches[0])
        embed = self.model.model.embed_tokens.weight
        cos, signed_sin = self.model.rotary.cos_sin(positions, embed.dtype)
        # what SDPA makes of the boolean mask in every layer's call (0 where seen, -inf elsewhere), once
        mask = torch.zeros(plan.mask.shape, dtype=embed.dtype).masked_fill_(plan.mask.logical_not(), float("-inf"))
        return torch.ops.radixserve.short_step(
            input_ids, embed, cos, signed_sin, self.weights, self.biases, self.model.model.norm.weight,
            self.k_caches, self.v_caches, meta.slot_mapping, plan.blocks, mask, plan.tokens, plan.real,
            plan.targets, k_buffer, v_buffer, self.pads, [*self.heads, plan.num_rows, plan.max_query, plan.max_len],
            self.eps, self.scale,
        )


def compiled_cpu_step(model: LlamaForCausalLM, kv_cache: KVCache, backend: object, ops: ModelOps) -> CpuStep | None:
    """The C++ step for this model and cache, built or loaded now (the log says which and how long),
    or None, with the reason logged, where it does not apply or cannot be built."""
    reason = unsupported(model, kv_cache, backend, ops)
    if reason is not None:
        log.info("CPU step: Python layers (%s)", reason)
        return None
    try:
        extension = load_extension()
    except Exception as error:  # no compiler, no headers, a failed build: the Python layers still run
        log.warning("CPU step: Python layers, the C++ step could not be built (%s)", str(error).strip()[:500])
        return None
    assert isinstance(backend, TorchAttentionBackend)
    log.info("CPU step: compiled C++ layers for decode and verification steps, %s in %.1f s (%s)",
             "built" if extension.built else "loaded", extension.seconds, extension.directory)
    return CpuStep(model, kv_cache, backend)

