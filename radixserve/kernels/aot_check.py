"""Compile the kernels for NVIDIA GPUs on a machine without one: the GPU checks CI can still do.

The interpreter tests prove the math; they cannot prove the kernels compile for a real target
(tl.dot shape limits, constexpr handling, early returns) or that a config's tiles fit in shared
memory. This module swaps Triton's driver for a stand-in that reports a chosen architecture and
its shared-memory limit and turns launches into no-ops, then calls the public wrappers on CPU
tensors, so the real JIT path compiles real PTX/cubin (Triton ships ptxas) and the wrappers' own
fallback on OutOfResources runs exactly as it would on that GPU. Nothing is computed.

Run without TRITON_INTERPRET: `python -m radixserve.kernels.aot_check --arch 80 90 --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# max dynamic shared memory per block (opt-in), bytes, from the CUDA programming guide's tables
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class CompiledVariant:
    kernel: str
    num_warps: int
    num_stages: int
    shared: int
    fits: bool
    tensor_cores: bool


class _StandInUtils:
    def __init__(self, max_shared: int) -> None:
        self.max_shared = max_shared

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.max_shared, "multiprocessor_count": 132, "max_num_regs": 65536}

    def load_binary(self, name, kernel, shared, device):
        return object(), object(), 0, 0, 1024  # module, function, n_regs, n_spills, max threads


class _StandInDriver:
    """Just enough of Triton's CUDA driver to compile and 'load'; launches do nothing."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _StandInUtils(MAX_SHARED[arch])

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stand_in_gpu(arch: int) -> Iterator[None]:
    from triton.runtime import driver

    from radixserve.kernels import common

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("aot_check compiles real GPU code: run it without TRITON_INTERPRET=1")
    if arch not in MAX_SHARED:
        raise ValueError(f"unknown arch {arch}; known: {sorted(MAX_SHARED)}")
    previous = driver._active  # private, but set_active/reset_active would create the real driver
    driver.set_active(_StandInDriver(arch))
    common.COMPILE_ONLY = True
    _forget_device_facts()  # what fits is per GPU: forget what another arch taught
    try:
        yield
    finally:
        common.COMPILE_ONLY = False
        driver._active = previous
        _forget_device_facts()


def _forget_device_facts() -> None:
    from triton.compiler import compiler

    from radixserve.kernels import common

    common._FITTING.clear()
    compiler.max_shared_mem.cache_clear()  # lru-cached per device index, which every stand-in calls 0


def _compiled(kernel) -> list[CompiledVariant]:
    found = []
    for caches in kernel.device_caches.values():
        for compiled in caches[0].values():
            meta = compiled.metadata
            ptx = compiled.asm.get("ptx", "")
            found.append(CompiledVariant(
                kernel=compiled.name, num_warps=meta.num_warps, num_stages=meta.num_stages, shared=meta.shared,
                fits=meta.shared <= MAX_SHARED[meta.target.arch],
                tensor_cores="mma" in ptx,
            ))
    return found


def check_arch(arch: int, dtype: torch.dtype, head_dim: int, group: int = 4, block_size: int = 16,
               kv_cache_dtype: str = "auto") -> list[CompiledVariant]:
    """Drive every attention wrapper once per code path (decode with 1 and several splits, extend, store),
    on caches in `dtype` or (kv_cache_dtype "fp8") in FP8 rows."""
    import radixserve.kernels as kernels
    from radixserve.kernels import decode, extend, fp8_format, kv_store

    num_kv_heads, num_blocks, batch = 2, 8, 2
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    if kv_cache_dtype == "fp8":
        k_cache, v_cache = fp8_format.quantize(k_cache), fp8_format.quantize(v_cache)
    table = torch.arange(num_blocks, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), 2 * block_size, dtype=torch.int32)
    with stand_in_gpu(arch):
        for kernel in (decode._decode_split_kernel, decode._merge_kernel, extend._extend_kernel,
                       kv_store._store_kv_kernel):
            kernel.device_caches.clear()
        q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
        kernels.store_kv(q[:, :num_kv_heads], q[:, :num_kv_heads], k_cache, v_cache, torch.tensor([0, 5]))
        for splits in (1, 4):
            kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 0.1, num_splits=splits)
        cu = torch.tensor([0, 1, 3], dtype=torch.int32)
        kernels.paged_extend_attention(q.repeat(2, 1, 1)[:3], k_cache, v_cache, table, cu, seq_lens, 0.1)
        found = []
        for kernel in (kv_store._store_kv_kernel, decode._decode_split_kernel, decode._merge_kernel,
                       extend._extend_kernel):
            found += _compiled(kernel)
    return found


def check_fused(arch: int, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
                ) -> list[CompiledVariant]:
    """Compile the fused kernels (kernels.fused), two code paths each, per dtype."""
    import radixserve.kernels as kernels
    from radixserve.kernels import fused

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(64, 64, generator=gen)
    with stand_in_gpu(arch):
        compiled = (fused._add_rms_norm_kernel, fused._rotary_qk_kernel, fused._silu_and_mul_kernel)
        for kernel in compiled:
            kernel.device_caches.clear()
        for dtype in dtypes:
            for tokens, hidden, residual in ((3, 200, True), (2, 10000, False)):  # one pass; looped over blocks
                x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                kernels.add_rms_norm(x, x if residual else None, x[0], 1e-6)
            for hq, hkv, dim in ((4, 1, 128), (8, 2, 64)):
                qkv = torch.randn(2, (hq + 2 * hkv) * dim, generator=gen).to(dtype)
                q, k, _ = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
                kernels.rotary_qk_(q.reshape(2, hq, dim), k.reshape(2, hkv, dim), torch.tensor([1, 5]),
                                   table[:, : dim // 2], table[:, : dim // 2])
            for inter in (100, 14336):
                kernels.silu_and_mul(torch.randn(2, 2 * inter, generator=gen).to(dtype))
        return [v for kernel in compiled for v in _compiled(kernel)]


def check_recurrent(arch: int) -> list[CompiledVariant]:
    """Compile the recurrent layers' kernels (kernels.recurrent) at Qwen3.5's, Nemotron-H's and LFM2's
    head shapes: the delta rule at dk = dv = 128, the Mamba2 scan at 64 x 128, the convolution in bf16
    with and without a bias."""
    from radixserve.kernels import recurrent

    compiled = (recurrent._delta_rule_kernel, recurrent._mamba2_kernel, recurrent._conv_kernel,
                recurrent._conv_window_kernel)
    with stand_in_gpu(arch):
        for kernel in compiled:
            kernel.device_caches.clear()
        items = recurrent.StepItems.make([3, 1], [0, 1], [True, False], torch.device("cpu"))
        tokens, heads = 4, 2
        keys, per_head = torch.zeros(tokens, heads, 128), torch.zeros(tokens, heads)
        recurrent.gated_delta_rule(keys, keys, keys, per_head, per_head, torch.zeros(2, heads, 128, 128), items,
                                   torch.zeros(tokens, heads, 128))
        shared = torch.zeros(tokens, 1, 128)
        recurrent.mamba2_scan(torch.zeros(tokens, heads, 64), per_head, per_head, shared, shared,
                              torch.zeros(2, heads, 64, 128), items, torch.zeros(tokens, heads, 64))
        for bias in (None, torch.zeros(6144, dtype=torch.bfloat16)):
            recurrent.causal_conv(torch.zeros(tokens, 6144, dtype=torch.bfloat16),
                                  torch.zeros(2, 3, 6144, dtype=torch.bfloat16),
                                  torch.zeros(6144, 4, dtype=torch.bfloat16), bias, items)
        return [v for kernel in compiled for v in _compiled(kernel)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixserve.kernels.aot_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(MAX_SHARED))
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--group", type=int, default=4, help="q heads per kv head")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = parser.parse_args(argv)
    ok = True
    for arch in args.arch:
        for dtype_name in args.dtype:
            for head_dim in args.head_dim:
                variants = check_arch(arch, getattr(torch, dtype_name), head_dim, args.group,
                                      kv_cache_dtype=args.kv_cache_dtype)
                for v in variants:
                    print(f"sm_{arch} {dtype_name:9} D={head_dim:<4} {v.kernel:22} warps={v.num_warps} "
                          f"stages={v.num_stages} shared={v.shared:>6} B {'fits' if v.fits else 'TOO BIG (fell back)'}"
                          f"{'  mma' if v.tensor_cores else ''}")
                # the wrappers fall back past configs that do not fit; each kernel's last one is the one used
                last = {v.kernel: v for v in variants}
                ok &= len(last) == 4 and all(v.fits for v in last.values())
        for v in check_fused(arch, tuple(getattr(torch, name) for name in args.dtype)):
            print(f"sm_{arch} fused {v.kernel:22} warps={v.num_warps} shared={v.shared:>6} B "
                  f"{'fits' if v.fits else 'TOO BIG'}")
            ok &= v.fits
        for v in check_recurrent(arch):
            print(f"sm_{arch} recurrent {v.kernel:22} warps={v.num_warps} shared={v.shared:>6} B "
                  f"{'fits' if v.fits else 'TOO BIG'}")
            ok &= v.fits
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
