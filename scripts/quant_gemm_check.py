"""GPU check of the quantized-weight GEMMs (radixserve/kernels/quant_gemm.py), run by scripts/gpu_check.sh.

1. correctness on CUDA: FP8 (per-channel and 128x128 block scales) and int4 (group 128) against
   dequantize-then-fp32-matmul, bf16 and fp16 x, odd shapes and the 8B decode shapes, split-K on and off:
   within one ulp of the largest output (fp32 accumulation order aside, the kernels round once);
2. timing of the decode GEMMs of a Llama-3.1-8B layer (4096x4096, 4096x14336, 14336x4096 as [K, N]) at
   batch 1 and 64, bf16 x, FP8 and AWQ-style int4 weights, and torch's bf16 linear for comparison:
   mean us eager (triton.testing.do_bench) and replayed in a CUDA graph (as the engine's decode
   steps run), against the roofline of the weight bytes each reads (bytes / device copy bandwidth);
3. the MXFP4 MoE (gpt-oss-20b's experts: 32 of 2880 x 2880, top 4): equal to fused_experts on the
   dequantized bf16 experts, and timed at batch 1 and 64 against the routed experts' bytes, beside
   fused_experts on those bf16 experts.
Exit 1 on a correctness failure. Well under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing

from radixserve.kernels.quant_formats import Fp8Weight, Int4Weight, QuantWeight, dequantize, pack_int4_along_k
from radixserve.kernels.quant_gemm import fp8_linear, int4_linear, quant_linear

SHAPES_8B = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N): attention out, MLP up, MLP down
BATCHES = [1, 64]


def fp8_weight(n: int, k: int, block: int | None, device: torch.device) -> Fp8Weight:
    bits = (torch.randn(n, k, device=device) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    if block is None:
        return Fp8Weight(bits, torch.rand(n, 1, device=device) * 1e-2 + 1e-3, k)
    blocks = torch.rand(-(-n // block), -(-k // block), device=device) * 1e-2 + 1e-3
    return Fp8Weight(bits, blocks.repeat_interleave(block, 0)[:n].contiguous(), block)


def int4_weight(n: int, k: int, group: int, device: torch.device) -> Int4Weight:
    groups = -(-k // group)
    values = torch.randint(0, 16, (k, n), device=device)
    return Int4Weight(pack_int4_along_k(values), torch.randint(0, 16, (groups, n), device=device, dtype=torch.uint8),
                      torch.rand(groups, n, device=device) * 1e-2 + 1e-3, group, k)


def weight_bytes(w: QuantWeight) -> int:
    if isinstance(w, Fp8Weight):
        return w.weight.numel() + w.scale.numel() * 4
    return w.qweight.numel() * 4 + w.zeros.numel() + w.scales.numel() * 4


def check(name: str, out: torch.Tensor, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> bool:
    ref = torch.nn.functional.linear(x.float(), dequantize(w), None if bias is None else bias.float())
    err = (out.float() - ref.to(x.dtype).float()).abs().max().item()
    limit = torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1.0)
    ok = err <= limit
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |out - ref| {err:.3g} (limit {limit:.3g})")
    return ok


def correctness(device: torch.device) -> bool:
    ok = True
    gen = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    cases = [(torch.bfloat16, 1, 1000, 768, None), (torch.bfloat16, 1, 1000, 768, 1), (torch.float16, 7, 4101, 1280, None),
             (torch.bfloat16, 64, 4096, 4096, None), (torch.bfloat16, 200, 257, 384, None)]
    for dtype, m, n, k, split in cases:
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        bias = torch.randn(n, device=device, generator=gen).to(dtype)
        for label, w in (("fp8 per-channel", fp8_weight(n, k, None, device)),
                         ("fp8 block 128", fp8_weight(n, k, 128, device)),
                         ("int4 group 128", int4_weight(n, k, 128, device))):
            run = fp8_linear if isinstance(w, Fp8Weight) else int4_linear
            out = run(x, w, bias, split=split)  # type: ignore[operator]
            ok &= check(f"{label} {dtype} M={m} N={n} K={k} split={split or 'auto'}", out, x, w, bias)
    for k, n in SHAPES_8B:
        for m in BATCHES:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            for label, w in (("fp8 block 128", fp8_weight(n, k, 128, device)),
                             ("int4 group 128", int4_weight(n, k, 128, device))):
                ok &= check(f"{label} 8B M={m} K={k} N={n}", quant_linear(x, w), x, w, None)
    return ok


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * nbytes / (ms * 1e-3)


def graph_us(fn) -> float | None:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
    except Exception as exc:  # report it and go on with the eager number
        print(f"  (CUDA graph timing failed: {type(exc).__name__}: {exc})")
        return None


def timing(device: torch.device, bandwidth: float) -> list[dict]:
    print(f"{'weights':<16}{'M':>4}{'K':>7}{'N':>7}{'MB':>8}{'eager us':>10}{'graph us':>10}{'floor us':>10}"
          f"{'roofline':>10}")
    rows = []
    for k, n in SHAPES_8B:
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        kinds: list[tuple[str, QuantWeight | torch.Tensor]] = [
            ("fp8 block128", fp8_weight(n, k, 128, device)), ("int4 g128 (AWQ)", int4_weight(n, k, 128, device)),
            ("bf16 (torch)", dense)]
        for m in BATCHES:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            for label, w in kinds:
                if isinstance(w, torch.Tensor):
                    fn, nbytes = (lambda x=x, w=w: torch.nn.functional.linear(x, w)), w.numel() * 2
                else:
                    fn, nbytes = (lambda x=x, w=w: quant_linear(x, w)), weight_bytes(w)
                eager = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
                graph = graph_us(fn)
                floor = nbytes / bandwidth * 1e6
                best = min(t for t in (eager, graph) if t is not None)
                rows.append(dict(weights=label, m=m, k=k, n=n, weight_bytes=nbytes, eager_us=eager, graph_us=graph,
                                 floor_us=floor, roofline_fraction=floor / best))
                print(f"{label:<16}{m:>4}{k:>7}{n:>7}{nbytes / 1e6:>8.1f}{eager:>10.1f}"
                      f"{graph if graph is not None else float('nan'):>10.1f}{floor:>10.1f}{floor / best:>10.2f}")
    return rows


def mxfp4_moe(device: torch.device, bandwidth: float) -> tuple[bool, list[dict]]:
    from radixserve.kernels.fused_moe import fused_experts
    from radixserve.kernels.fused_moe_mxfp4 import fused_experts_mxfp4
    from radixserve.kernels.moe import ExpertActivation
    from radixserve.kernels.mxfp4_format import Mxfp4Experts

    e, h, i, top_k = 32, 2880, 2880, 4
    u8 = lambda *shape, lo=0, hi=256: torch.randint(lo, hi, shape, device=device, dtype=torch.uint8)
    experts = Mxfp4Experts(u8(e, 2 * i, h // 32, 16), u8(e, 2 * i, h // 32, lo=118, hi=124), u8(e, h, i // 32, 16),
                           u8(e, h, i // 32, lo=118, hi=124), torch.randn(e, 2 * i, device=device).bfloat16() * 0.1,
                           torch.randn(e, h, device=device).bfloat16() * 0.1)
    dense = experts.dequantized(torch.bfloat16)
    act = ExpertActivation("clamped_swiglu")
    ok, rows = True, []
    per_expert = (experts.gate_up_blocks[0].numel() + experts.gate_up_scales[0].numel()
                  + experts.down_blocks[0].numel() + experts.down_scales[0].numel())
    print(f"{'MoE experts':<16}{'M':>4}{'active':>8}{'MB':>8}{'eager us':>10}{'graph us':>10}{'floor us':>10}"
          f"{'roofline':>10}")
    for m in BATCHES:
        x = torch.randn(m, h, device=device).bfloat16()
        ids = torch.stack([torch.randperm(e, device=device)[:top_k] for _ in range(m)])
        weights = torch.softmax(torch.randn(m, top_k, device=device), -1)
        got = fused_experts_mxfp4(x, ids, weights, experts, act)
        want = fused_experts(x, ids, weights, dense, act)
        same = torch.equal(got, want)
        close = (got.float() - want.float()).abs().max().item() <= 1e-2 * max(want.float().abs().max().item(), 1.0)
        print(f"  {'ok  ' if close else 'FAIL'} MXFP4 MoE M={m}: {'bit-identical to' if same else 'close to'} "
              "fused_experts on the dequantized experts")
        ok &= close
        active = int(ids.unique().numel())
        for label, fn, nbytes in (
                ("mxfp4", lambda x=x, ids=ids, w=weights: fused_experts_mxfp4(x, ids, w, experts, act), per_expert),
                ("bf16", lambda x=x, ids=ids, w=weights: fused_experts(x, ids, w, dense, act), 3 * h * i * 2)):
            eager = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
            graph = graph_us(fn)
            total = active * nbytes
            floor = total / bandwidth * 1e6
            best = min(t for t in (eager, graph) if t is not None)
            rows.append(dict(weights=f"moe {label}", m=m, active_experts=active, weight_bytes=total, eager_us=eager,
                             graph_us=graph, floor_us=floor, roofline_fraction=floor / best))
            print(f"{'moe ' + label:<16}{m:>4}{active:>8}{total / 1e6:>8.1f}{eager:>10.1f}"
                  f"{graph if graph is not None else float('nan'):>10.1f}{floor:>10.1f}{floor / best:>10.2f}")
    return ok, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm_check: no CUDA device")
        return 1
    device = torch.device("cuda")
    print("correctness vs dequantize-then-matmul (fp32):")
    ok = correctness(device)
    bandwidth = copy_bandwidth(device)
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows = timing(device, bandwidth)
    moe_ok, moe_rows = mxfp4_moe(device, bandwidth)
    ok &= moe_ok
    rows += moe_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "correct": ok, "rows": rows}, f, indent=1)
    print(f"quant_gemm_check: {'correct' if ok else 'INCORRECT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
