"""Triton paged-attention kernels on a CUDA GPU: correctness first, then speed.

1. Correctness: decode (auto and forced split counts) and extend on ragged batches over shuffled
   blocks, against the fp32 torch references; relative Frobenius error must be <= --tolerance.
2. Decode (Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128) per batch x context:
   median time (triton.testing.do_bench), bandwidth = (K/V read + q + out) / time as % of a
   measured device-to-device copy (read + write), and torch SDPA's time on the same data laid out
   contiguously.
3. Extend: one sequence's chunk over a cached prefix, vs SDPA with a bottom-right causal mask.
Targets: decode >= 70% of copy bandwidth at batch 64 x ctx 4096; extend >= 0.7x SDPA at chunk 2048
over prefix 4096. Exit 0 when correct (with --require-targets, also when on target), 1 when a
check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

Timer = Callable[[Callable[[], object]], float]  # fn -> median milliseconds


@dataclass(frozen=True)
class Shapes:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Row:
    kind: str  # decode | extend
    a: int  # decode: batch; extend: chunk
    b: int  # decode: context; extend: prefix
    ms: float | None = None
    metric: float | None = None  # decode: % of copy bandwidth; extend: TFLOP/s
    sdpa_ms: float | None = None
    note: str = ""

    @property
    def vs_sdpa(self) -> float | None:
        return self.sdpa_ms / self.ms if self.ms and self.sdpa_ms else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 4096])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tolerance", type=float, default=1e-2, help="max relative error vs the fp32 reference")
    p.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA comparison")
    p.add_argument("--require-targets", action="store_true", help="exit 1 when a performance target is missed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("radixserve bench kernels needs a CUDA GPU (torch.cuda.is_available() is False); the kernels' "
              "CPU checks are `pytest tests/test_kernels.py` (Triton interpreter) and `python -m kernels.aot_check`",
              file=sys.stderr)
        return 2
    import triton.testing

    device = torch.device("cuda")
    shapes = Shapes(block_size=args.block_size, dtype=getattr(torch, args.dtype))
    timer: Timer = lambda fn: triton.testing.do_bench(fn, return_mode="median")
    props = torch.cuda.get_device_properties(device)
    copy_bw = copy_bandwidth(device, timer)
    print(f"device: {props.name} (sm_{props.major}{props.minor}), device-to-device copy {copy_bw / 1e12:.2f} TB/s "
          f"(1 GiB copy, read + write)")
    errors = check_correctness(device, shapes)
    print(f"correctness ({args.dtype}, relative error vs fp32 reference, limit {args.tolerance:g}):")
    for name, err in errors.items():
        print(f"  {name:40} {err:.2e}  {'ok' if err <= args.tolerance else 'FAIL'}")
    if any(not err <= args.tolerance for err in errors.values()):
        return 1
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows.append(bench_decode(device, shapes, batch, context, copy_bw, timer, not args.no_sdpa))
            torch.cuda.empty_cache()  # the row's tensors are gone: hand their memory to the next, larger row
    rows += [bench_extend(device, shapes, c, p, timer, not args.no_sdpa) for c in args.chunks for p in args.prefixes]
    print(format_rows(rows, shapes))
    targets = check_targets(rows)
    for line, ok in targets:
        print(f"target: {line}: {'PASS' if ok else 'MISS' if ok is False else 'not measured'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "copy_bandwidth_Bps": copy_bw, "correctness": errors,
                       "rows": [asdict(r) | {"vs_sdpa": r.vs_sdpa} for r in rows]}, f, indent=2)
    return 1 if args.require_targets and not all(ok for _, ok in targets) else 0


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def to_paged(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """[B, S, Hkv, D] contiguous K/V -> caches [B * ceil(S/bs), bs, Hkv, D] in shuffled block order + table."""
    batch, seq, heads, dim = k.shape
    per_seq = math.ceil(seq / block_size)
    order = torch.randperm(batch * per_seq, generator=gen).to(k.device)
    caches = []
    for x in (k, v):
        if seq != per_seq * block_size:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, per_seq * block_size - seq))
        cache = torch.empty(batch * per_seq, block_size, heads, dim, dtype=x.dtype, device=x.device)
        cache[order] = x.reshape(batch * per_seq, block_size, heads, dim)
        caches.append(cache)
    return caches[0], caches[1], order.view(batch, per_seq).to(torch.int32)


def _random(shape: tuple[int, ...], shapes: Shapes, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=shapes.dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_correctness(
    device: torch.device,
    shapes: Shapes,
    decode_lens: tuple[int, ...] = (1, 15, 16, 17, 513, 1000, 4096, 33),
    extend_qlens: tuple[int, ...] = (512, 1, 37, 16),
    extend_prefixes: tuple[int, ...] = (3584, 999, 0, 16),
) -> dict[str, float]:
    """Relative errors of every kernel path against the fp32 references on ragged, shuffled batches."""
    import kernels
    from kernels.reference import (
        paged_decode_attention_reference,
        paged_extend_attention_reference,
        store_kv_reference,
    )

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hq, d, scale = shapes.num_q_heads, shapes.head_dim, shapes.head_dim**-0.5
    errors: dict[str, float] = {}
    k = _random((len(decode_lens), max(decode_lens), shapes.num_kv_heads, d), shapes, device)
    k_cache, v_cache, table = to_paged(k, _random(k.shape, shapes, device), shapes.block_size, gen)
    seq_lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
    q = _random((len(decode_lens), hq, d), shapes, device)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, table, seq_lens, scale)
    for splits in (None, 1, 7):
        out = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, num_splits=splits)
        errors[f"decode, {splits or 'auto'} split(s)"] = rel_err(out, ref)

    totals = [n + p for n, p in zip(extend_qlens, extend_prefixes)]
    k = _random((len(totals), max(totals), shapes.num_kv_heads, d), shapes, device)
    k_cache, v_cache, table = to_paged(k, _random(k.shape, shapes, device), shapes.block_size, gen)
    cu = torch.tensor([0, *torch.tensor(extend_qlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(totals, dtype=torch.int32, device=device)
    q = _random((sum(extend_qlens), hq, d), shapes, device)
    args = (q, k_cache, v_cache, table, cu, seq_lens, scale)
    errors["extend, chunks over prefixes + decodes"] = rel_err(
        kernels.paged_extend_attention(*args), paged_extend_attention_reference(*args))

    new_k, new_v = (_random((5, shapes.num_kv_heads, d), shapes, device) for _ in range(2))
    slots = torch.randperm(k_cache.shape[0] * shapes.block_size, generator=gen)[:5].to(device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(new_k, new_v, expected_k, expected_v, slots)
    kernels.store_kv(new_k, new_v, k_cache, v_cache, slots)
    exact = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    errors["store_kv (bit-exact copy)"] = 0.0 if exact else float("inf")
    return errors


def _fits(device: torch.device, nbytes: float) -> bool:
    return device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= nbytes


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lower_right: bool, timer: Timer):
    """Median ms of torch SDPA on [1|B, H, L, D] inputs, or None when no kernel takes these shapes."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if lower_right else None
    gqa = q.shape[1] != k.shape[1]
    try:
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                        enable_gqa=gqa)
        fn()
        return timer(fn)
    except (RuntimeError, NotImplementedError) as exc:
        print(f"  (sdpa unavailable for {tuple(q.shape)} x {tuple(k.shape)}: {str(exc).splitlines()[0]})")
        return None


def bench_decode(device, shapes: Shapes, batch: int, context: int, copy_bw: float, timer: Timer, sdpa: bool) -> Row:
    import kernels

    row = Row("decode", batch, context)
    kv_bytes = 2 * batch * context * shapes.num_kv_heads * shapes.head_dim * shapes.elem
    if not _fits(device, 2.1 * kv_bytes):
        row.note = f"skipped: needs {2.1 * kv_bytes / 2**30:.0f} GiB free"
        return row
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    torch.manual_seed(batch * 7919 + context)
    k = _random((batch, context, shapes.num_kv_heads, shapes.head_dim), shapes, device)
    v = _random(k.shape, shapes, device)
    k_cache, v_cache, table = to_paged(k, v, shapes.block_size, gen)
    q = _random((batch, shapes.num_q_heads, shapes.head_dim), shapes, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out, scale = torch.empty_like(q), shapes.head_dim**-0.5
    row.ms = timer(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale,
                                                          max_seq_len=context, out=out))
    moved = kv_bytes + 2 * q.numel() * shapes.elem
    row.metric = 100 * moved / (row.ms * 1e-3) / copy_bw
    if sdpa:
        row.sdpa_ms = _sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale, False, timer)
    return row


def bench_extend(device, shapes: Shapes, chunk: int, prefix: int, timer: Timer, sdpa: bool) -> Row:
    import kernels

    row = Row("extend", chunk, prefix)
    total = chunk + prefix
    gen = torch.Generator().manual_seed(chunk * 31 + prefix)
    torch.manual_seed(chunk * 31 + prefix)
    k = _random((1, total, shapes.num_kv_heads, shapes.head_dim), shapes, device)
    v = _random(k.shape, shapes, device)
    k_cache, v_cache, table = to_paged(k, v, shapes.block_size, gen)
    q = _random((chunk, shapes.num_q_heads, shapes.head_dim), shapes, device)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    out, scale = torch.empty_like(q), shapes.head_dim**-0.5
    row.ms = timer(lambda: kernels.paged_extend_attention(q, k_cache, v_cache, table, cu, seq_lens, scale,
                                                          max_query_len=chunk, out=out))
    pairs = chunk * prefix + chunk * (chunk + 1) / 2  # (query, visible key) pairs under the causal mask
    row.metric = 4 * shapes.num_q_heads * shapes.head_dim * pairs / (row.ms * 1e-3) / 1e12
    if sdpa:
        group = shapes.num_q_heads // shapes.num_kv_heads
        # heads expanded up front (not timed): SDPA's bottom-right causal path has no GQA
        k4 = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v4 = v.transpose(1, 2).repeat_interleave(group, dim=1)
        row.sdpa_ms = _sdpa(q.transpose(0, 1)[None], k4, v4, scale, True, timer)
    return row


def format_rows(rows: list[Row], shapes: Shapes) -> str:
    head = (f"Hq={shapes.num_q_heads} Hkv={shapes.num_kv_heads} D={shapes.head_dim} {str(shapes.dtype)[6:]} "
            f"block {shapes.block_size}; vs sdpa = sdpa time / our time (> 1: faster than SDPA)")
    columns = (f"{'kernel':8} {'batch|chunk':>11} {'ctx|prefix':>10} {'ms':>9} {'%copy|TFLOP/s':>14} "
               f"{'sdpa ms':>9} {'vs sdpa':>8}")
    lines = [head, columns]
    for r in rows:
        cells = [f"{r.ms:9.4f}" if r.ms else f"{'-':>9}", f"{r.metric:14.1f}" if r.metric else f"{'-':>14}",
                 f"{r.sdpa_ms:9.4f}" if r.sdpa_ms else f"{'-':>9}", f"{r.vs_sdpa:8.2f}" if r.vs_sdpa else f"{'-':>8}"]
        lines.append(f"{r.kind:8} {r.a:11} {r.b:10} {' '.join(cells)} {r.note}".rstrip())
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[str, bool | None]]:
    by_key = {(r.kind, r.a, r.b): r for r in rows}
    decode = by_key.get(("decode", 64, 4096))
    extend = by_key.get(("extend", 2048, 4096))
    return [
        ("decode batch 64 x ctx 4096 >= 70% of copy bandwidth",
         None if decode is None or decode.metric is None else decode.metric >= 70.0),
        ("extend chunk 2048 over prefix 4096 >= 0.7x SDPA",
         None if extend is None or extend.vs_sdpa is None else extend.vs_sdpa >= 0.7),
    ]
