"""Shared plumbing for the paged-attention kernels: input checks, launch configs, dot precision.

Invariants the kernels rely on, enforced here before any launch:
- caches are [num_blocks, block_size, Hkv, D] with block_size >= 16, the same dtype as q, or FP8
  caches: uint8 [num_blocks, block_size, Hkv, D + 2], each row D e4m3 bytes and a bfloat16 scale
  (radixserve/kernels/fp8_format.py; radixserve/kernels/fp8.py), read and written with q in any supported dtype;
- Hq is a multiple of Hkv;
- every tensor is on a CUDA device, or Triton runs in its interpreter (TRITON_INTERPRET=1 set before
  triton was imported), in which case CPU tensors are fine and their index values are also checked
  (free on CPU; on CUDA that would cost a host sync per layer, so there the engine is trusted);
- an attention variant (`AttentionVariant`: sliding window >= 1, softcap > 0, sinks [Hq] contiguous
  floats on q's device) is checked here too; `scores_log2` is the one place both kernels turn q.k
  products into (soft-capped) base-2 logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels import fp8_format

try:
    from triton.runtime.errors import OutOfResources
except ImportError as exc:  # pragma: no cover - triton ships with the Linux x86_64 install
    raise ImportError(
        "the Triton kernels need the `triton` package (installed with radixserve on Linux x86_64); "
        "use --attention-backend torch elsewhere"
    ) from exc

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the same, for use inside kernels
MIN_BLOCK_SIZE = 16
# set only by kernels.aot_check while a stand-in driver compiles for a GPU this machine lacks
COMPILE_ONLY = False
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == fp8_format.STORAGE


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (it then runs on the CPU in numpy)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def head_dim_pad(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot a K of at least 16
    return max(16, next_pow2(head_dim))


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all kernel inputs must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not is_interpreted(kernel) and not COMPILE_ONLY:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU they only run under the interpreter: "
            "set TRITON_INTERPRET=1 before triton is imported, or use the torch attention backend"
        )


def should_check_values(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    if k_cache.dtype not in SUPPORTED_DTYPES and not is_fp8_cache(k_cache):
        raise ValueError(f"cache dtype {k_cache.dtype} unsupported; use float16, bfloat16, float32 or FP8 rows (uint8)")
    num_blocks, block_size, num_kv_heads, row = k_cache.shape
    head_dim = row - fp8_format.SCALE_BYTES if is_fp8_cache(k_cache) else row
    if is_fp8_cache(k_cache) and (k_cache.stride(3) != 1 or head_dim < 2 or head_dim % 2):
        raise ValueError(f"an FP8 cache needs contiguous rows of an even head_dim plus 2 scale bytes, got {row}")
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is below {MIN_BLOCK_SIZE}: the Triton kernels support blocks of "
            f">= {MIN_BLOCK_SIZE} tokens (tl.dot needs K >= 16 on NVIDIA, which the CPU interpreter "
            "would not catch); use --block-size 16, 32 or 64 or the torch backend"
        )
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Validate q [N, Hq, D] against the cache and return the GQA group size Hq // Hkv."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype != k_cache.dtype and not (is_fp8_cache(k_cache) and q.dtype in SUPPORTED_DTYPES):
        raise ValueError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={num_kv_heads}")
    return q.shape[1] // num_kv_heads


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer (same shape, dtype and device as q), or a fresh one."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    return out


def check_int_vector(name: str, t: torch.Tensor, length: int, dtype: torch.dtype) -> None:
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_block_table(block_table: torch.Tensor, batch: int, num_blocks: int) -> None:
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [{batch}, max_blocks], got {tuple(block_table.shape)}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")


def check_table_covers(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """Value checks (CPU only): every position < seq_len maps to an existing physical block."""
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    need = (seq_lens.long() + block_size - 1) // block_size
    if int(need.max()) > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns, a sequence needs {int(need.max())}")
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = block_table[cols[None, :] < need[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_table references a block outside [0, {num_blocks})")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to TF32 on NVIDIA (10-bit mantissa); fp32 callers want fp32 results
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_in_kernel(kernel: object, dtype: torch.dtype) -> bool:
    # the interpreter stores bf16 as raw uint16 bits and cannot do arithmetic on them: convert on load
    return dtype == torch.bfloat16 and is_interpreted(kernel)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and scheduling hints for one launch; block_m is unused by the decode kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


_FITTING: dict[tuple, int] = {}  # (kernel, dtype, head_dim, device, ...) -> index of the first config that fit


def launch_with_fallback(
    launch: Callable[[LaunchConfig], None], configs: list[LaunchConfig], key: tuple
) -> LaunchConfig:
    """Run `launch` with the first config whose tiles fit the device (shared memory differs per GPU).

    A config that does not fit keeps raising OutOfResources on every launch, so the index of the one
    that fitted is remembered per `key` and later launches start there.
    """
    last: Exception | None = None
    start = _FITTING.get(key, 0)
    for index in range(start, len(configs)):
        try:
            launch(configs[index])
        except OutOfResources as exc:
            last = exc
            continue
        if index != start:
            _FITTING[key] = index
        return configs[index]
    raise RuntimeError(f"no launch config fits this device: {last}")


def scheduling_kwargs(kernel: object, cfg: LaunchConfig) -> dict[str, int]:
    return {} if is_interpreted(kernel) else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


@dataclass(frozen=True)
class AttentionVariant:
    """What a layer's attention adds to plain causal softmax; the same for every layer of one kind.

    `window`: the query at position p sees keys p - window < j <= p (None: all j <= p). `softcap`:
    scores s become softcap * tanh(s / softcap) before masking. `sinks`: the layer has a learned logit
    per q head that joins each softmax's denominator with no value (the tensor itself is per layer
    and passed at launch). Part of a plan: layers that differ here need plans of their own.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def constants(self) -> dict[str, bool]:
        return {"HAS_WINDOW": self.window is not None, "SOFTCAP": self.softcap is not None, "SINKS": self.sinks}

    def scalars(self, scale: float) -> tuple[float, float, int]:
        """(score_scale, cap_log2, window) as `scores_log2` and the kernels take them."""
        window = 0 if self.window is None else self.window
        if self.softcap is None:
            return scale * LOG2E, 0.0, window
        # tanh(x) is computed as 1 - 2 / (2^(2 x log2 e) + 1), x = scale q.k / softcap
        return 2.0 * LOG2E * scale / self.softcap, self.softcap * LOG2E, window


def check_variant(
    q: torch.Tensor, window: int | None, sinks: torch.Tensor | None, softcap: float | None
) -> AttentionVariant:
    """Validate the optional attention features against q [N, Hq, D]."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**31):
        raise ValueError(f"window must be an int in [1, 2^31), got {window!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if sinks is not None:
        check_sinks(sinks, q)
    return AttentionVariant(window, None if softcap is None else float(softcap), sinks is not None)


def check_sinks(sinks: torch.Tensor, q: torch.Tensor) -> None:
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or sinks.stride(0) != 1:
        raise ValueError(f"sinks must be a contiguous [Hq={q.shape[1]}] vector, got shape {tuple(sinks.shape)}")
    if sinks.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"sinks dtype {sinks.dtype} unsupported; use float16, bfloat16 or float32")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


@triton.jit
def scores_log2(qk, score_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Raw q.k products -> base-2 logits, soft-capped when SOFTCAP (arguments from AttentionVariant.scalars)."""
    if SOFTCAP:
        # tanh through exp2, which the GPU and the interpreter both have; it saturates to +-1 cleanly
        # (2^x overflowing to inf gives 1, underflowing to 0 gives -1)
        return (1.0 - 2.0 / (tl.exp2(qk * score_scale) + 1.0)) * cap_log2
    return qk * score_scale
