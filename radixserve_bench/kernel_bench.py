"""Triton paged-attention kernels on a CUDA GPU: correctness first, then speed.

1. Correctness: decode (auto and forced split counts) and extend on ragged batches over shuffled
   blocks, against the fp32 torch references; relative Frobenius error must be <= --tolerance.
2. Decode (Llama-3-8B attention: 32 q heads, 8 kv heads, head_dim 128) per batch x context:
   median time (triton.testing.do_bench), bandwidth = (K/V read + q + out) / time as % of a
   measured device-to-device copy (read + write), and torch SDPA's time on the same data laid out
   contiguously.
   Also each decode call back to back, eager and replayed from a CUDA graph (mean per call, events).
3. Extend: one sequence's chunk over a cached prefix, vs SDPA with a bottom-right causal mask.
4. Fused kernels (add_rms_norm, rotary_qk_, silu_and_mul) at Llama-3-8B widths vs their torch
   references: do_bench medians, the same under CUDA-graph replay, and the fraction of elements
   that differ from the reference at all. Rotary must be bit-identical, SiLU within 1 ulp, RMSNorm
   within 2 (a rare 1-ulp flip of the normalised value, from the mean square's summation order,
   becomes up to 2 ulps once multiplied by the weight): FUSED_MAX_ULP.
Targets: decode >= 70% of copy bandwidth at batch 64 x ctx 4096; extend >= 0.7x SDPA at chunk 2048
over prefix 4096. Exit 0 when correct (with --require-targets, also when on target), 1 when a
check fails (a fused kernel further off its reference than FUSED_MAX_ULP included), 2 without CUDA.
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
FUSED_MAX_ULP = {"add_rms_norm": 2, "rotary_qk_": 0, "silu_and_mul": 1}


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
    loop_ms: float | None = None  # decode: mean per call, back to back, eager
    graph_ms: float | None = None  # decode: mean per call, back to back, CUDA-graph replay

    @property
    def vs_sdpa(self) -> float | None:
        return self.sdpa_ms / self.ms if self.ms and self.sdpa_ms else None


@dataclass
class FusedRow:
    kernel: str  # add_rms_norm | rotary_qk_ | silu_and_mul
    tokens: int
    width: int  # hidden size | packed qkv width | intermediate size
    ms: float | None = None
    torch_ms: float | None = None
    graph_ms: float | None = None
    torch_graph_ms: float | None = None
    differ: float | None = None  # fraction of output elements not bit-identical to the torch reference
    max_ulp: int | None = None

    @property
    def speedup(self) -> float | None:
        return self.torch_ms / self.ms if self.ms and self.torch_ms else None

    @property
    def graph_speedup(self) -> float | None:
        return self.torch_graph_ms / self.graph_ms if self.graph_ms and self.torch_graph_ms else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 4096])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tolerance", type=float, default=1e-2, help="max relative error vs the fp32 reference")
    p.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA comparison")
    p.add_argument("--no-graph", action="store_true", help="skip the back-to-back eager / CUDA-graph decode timings")
    p.add_argument("--fused-tokens", type=int, nargs="*", default=[1, 64, 2048],
                   help="token counts for the fused-kernel rows (none: skip them)")
    p.add_argument("--hidden", type=int, default=4096, help="fused rows: hidden size (default %(default)s)")
    p.add_argument("--intermediate", type=int, default=14336, help="fused rows: MLP width (default %(default)s)")
    p.add_argument("--require-targets", action="store_true", help="exit 1 when a performance target is missed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("radixserve bench kernels needs a CUDA GPU (torch.cuda.is_available() is False); the kernels' "
              "CPU checks are `pytest tests/kernels/test_kernels.py` (Triton interpreter)"
              " and `python -m radixserve.kernels.aot_check`",
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
            rows.append(bench_decode(device, shapes, batch, context, copy_bw, timer, not args.no_sdpa,
                                     graph=not args.no_graph))
            torch.cuda.empty_cache()  # the row's tensors are gone: hand their memory to the next, larger row
    rows += [bench_extend(device, shapes, c, p, timer, not args.no_sdpa) for c in args.chunks for p in args.prefixes]
    print(format_rows(rows, shapes))
    fused = [row for tokens in args.fused_tokens
             for row in bench_fused(device, shapes, tokens, args.hidden, args.intermediate, timer)]
    fused_ok = all(r.max_ulp is not None and r.max_ulp <= FUSED_MAX_ULP[r.kernel] for r in fused)
    if fused:
        print(format_fused(fused, shapes))
        print(f"fused kernels within {FUSED_MAX_ULP} ulps of their torch references: {'ok' if fused_ok else 'FAIL'}")
    targets = check_targets(rows)
    for line, ok in targets:
        print(f"target: {line}: {'PASS' if ok else 'MISS' if ok is False else 'not measured'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "copy_bandwidth_Bps": copy_bw, "correctness": errors,
                       "rows": [asdict(r) | {"vs_sdpa": r.vs_sdpa} for r in rows],
                       "fused": [asdict(r) | {"speedup": r.speedup, "graph_speedup": r.graph_speedup} for r in fused]},
                      f, indent=2)
    if not fused_ok:
        return 1
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
    import radixserve.kernels as kernels
    from radixserve.kernels.reference import (
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


def back_to_back_ms(fn: Callable[[], object], reps: int = 200) -> tuple[float, float]:
    """(eager, graph): mean ms per call of `fn` run `reps` times back to back, timed with CUDA events.

    The graph is `fn` captured once with its inputs fixed and replayed `reps` times, so the difference
    is the host's per-call cost (Python wrapper, launch) that CUDA graphs remove. No L2 flush between
    calls, unlike do_bench: inputs that fit in L2 stay there.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture: compile, pick the launch config
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for run in (fn, graph.replay):
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return times[0], times[1]


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


def bench_decode(
    device, shapes: Shapes, batch: int, context: int, copy_bw: float, timer: Timer, sdpa: bool, graph: bool = False
) -> Row:
    import radixserve.kernels as kernels

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
    decode = lambda: kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale,
                                                    max_seq_len=context, out=out)
    row.ms = timer(decode)
    moved = kv_bytes + 2 * q.numel() * shapes.elem
    row.metric = 100 * moved / (row.ms * 1e-3) / copy_bw
    if graph and device.type == "cuda":
        row.loop_ms, row.graph_ms = back_to_back_ms(decode)
    if sdpa:
        row.sdpa_ms = _sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale, False, timer)
    return row


def bench_extend(device, shapes: Shapes, chunk: int, prefix: int, timer: Timer, sdpa: bool) -> Row:
    import radixserve.kernels as kernels

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


def ulp_distance(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units in the last place of their (shared) float dtype, elementwise, int64."""
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[out.dtype]
    sign = 1 << (8 * out.element_size() - 1)
    a, b = (t.contiguous().view(ints).long() for t in (out, ref))
    # sign-magnitude bits -> integers in the floats' order (-0 and +0 both map to 0)
    a, b = (torch.where(t < 0, -(t + sign), t) for t in (a, b))
    return (a - b).abs()


def bench_fused(device, shapes: Shapes, tokens: int, hidden: int, intermediate: int, timer: Timer) -> list[FusedRow]:
    """The three fused kernels at one token count against their torch references on the same device."""
    import radixserve.kernels as kernels
    from radixserve.kernels.reference import add_rms_norm_reference, rotary_qk_reference_, silu_and_mul_reference

    torch.manual_seed(tokens)
    hq, hkv, d = shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim
    x, res = _random((tokens, hidden), shapes, device), _random((tokens, hidden), shapes, device)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(shapes.dtype)
    qkv = _random((tokens, (hq + 2 * hkv) * d), shapes, device)
    max_pos = 8192
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=device).float() / d)
    angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    gate_up = _random((tokens, 2 * intermediate), shapes, device)

    def qk(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d)

    def rotated(fn: Callable[..., None]) -> torch.Tensor:
        t = qkv.clone()
        fn(*qk(t), positions, cos, sin)
        return t

    qkv_work = qkv.clone()  # rotated over and over while timing: only its speed matters
    cases = [
        ("add_rms_norm", hidden, lambda: kernels.add_rms_norm(x, res, weight, 1e-5),
         lambda: add_rms_norm_reference(x, res, weight, 1e-5), lambda out: torch.cat(out, dim=-1)),
        ("rotary_qk_", qkv.shape[1], lambda: kernels.rotary_qk_(*qk(qkv_work), positions, cos, sin),
         lambda: rotary_qk_reference_(*qk(qkv_work), positions, cos, sin), None),
        ("silu_and_mul", intermediate, lambda: kernels.silu_and_mul(gate_up),
         lambda: silu_and_mul_reference(gate_up), lambda out: out),
    ]
    rows = []
    for name, width, ours, ref, flat in cases:
        row = FusedRow(name, tokens, width)
        if flat is None:
            got, want = rotated(kernels.rotary_qk_), rotated(rotary_qk_reference_)
        else:
            got, want = flat(ours()), flat(ref())
        ulps = ulp_distance(got, want)
        row.differ = float((ulps > 0).float().mean())
        row.max_ulp = int(ulps.max())
        row.ms, row.torch_ms = timer(ours), timer(ref)
        if device.type == "cuda":
            row.graph_ms = back_to_back_ms(ours)[1]
            row.torch_graph_ms = back_to_back_ms(ref)[1]
        rows.append(row)
    return rows


def format_fused(rows: list[FusedRow], shapes: Shapes) -> str:
    head = (f"fused kernels, {str(shapes.dtype)[6:]}; x = torch time / our time; graph = mean per call replayed "
            f"back to back from a CUDA graph; differ = elements not bit-identical to torch (max ulp)")
    columns = (f"{'kernel':13} {'tokens':>6} {'width':>6} {'ms':>9} {'torch ms':>9} {'x':>6} "
               f"{'graph ms':>9} {'torch gr':>9} {'x':>6} {'differ':>9}")
    lines = [head, columns]
    num = lambda v, w, p: f"{v:{w}.{p}f}" if v else f"{'-':>{w}}"
    for r in rows:
        differ = f"{r.differ:.1e}({r.max_ulp})" if r.differ is not None else "-"
        lines.append(f"{r.kernel:13} {r.tokens:6} {r.width:6} {num(r.ms, 9, 4)} {num(r.torch_ms, 9, 4)} "
                     f"{num(r.speedup, 6, 2)} {num(r.graph_ms, 9, 4)} {num(r.torch_graph_ms, 9, 4)} "
                     f"{num(r.graph_speedup, 6, 2)} {differ:>9}")
    return "\n".join(lines)


def format_rows(rows: list[Row], shapes: Shapes) -> str:
    head = (f"Hq={shapes.num_q_heads} Hkv={shapes.num_kv_heads} D={shapes.head_dim} {str(shapes.dtype)[6:]} "
            f"block {shapes.block_size}; vs sdpa = sdpa time / our time (> 1: faster than SDPA); "
            f"loop / graph = decode per call back to back, eager / CUDA-graph replay")
    columns = (f"{'kernel':8} {'batch|chunk':>11} {'ctx|prefix':>10} {'ms':>9} {'%copy|TFLOP/s':>14} "
               f"{'sdpa ms':>9} {'vs sdpa':>8} {'loop ms':>9} {'graph ms':>9}")
    lines = [head, columns]
    for r in rows:
        cells = [f"{r.ms:9.4f}" if r.ms else f"{'-':>9}", f"{r.metric:14.1f}" if r.metric else f"{'-':>14}",
                 f"{r.sdpa_ms:9.4f}" if r.sdpa_ms else f"{'-':>9}", f"{r.vs_sdpa:8.2f}" if r.vs_sdpa else f"{'-':>8}",
                 f"{r.loop_ms:9.4f}" if r.loop_ms else f"{'-':>9}", f"{r.graph_ms:9.4f}" if r.graph_ms else f"{'-':>9}"]
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
