"""GPU check of the recurrent scans' chunked form (radixserve/kernels/recurrent.py), run by scripts/gpu_check.sh.

1. correctness on CUDA: the gated delta rule at Qwen3.5's layer shape (32 value heads, dk = dv = 128)
   and the Mamba2 scan at Nemotron-H's (128 heads of 64 channels, 8 groups, state 128), over a step of
   one long prompt and a step mixing prompts, decodes and a chunk's edge, in the chunked form against
   the same kernel token by token (chunk 0): outputs and states within 1e-4 of the largest value;
2. timing (triton.testing.do_bench) of a prefill step of 4,096 tokens as one item and as 8 items of
   512, chunked and token by token: tokens/s per layer and the speed-up, with each compiled kernel's
   registers and spilled bytes.
Exit 1 on a correctness failure. Well under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import torch
import triton.testing

from radixserve.kernels import recurrent
from radixserve.kernels.recurrent import PREFILL_CHUNK, StepItems, gated_delta_rule, mamba2_scan

DELTA = {"heads": 32, "dk": 128, "dv": 128}  # Qwen3.5's Gated DeltaNet layers
MAMBA = {"heads": 128, "groups": 8, "p": 64, "n": 128}  # Nemotron-H's Mamba2 layers
MIXED = [700, 1, 33, PREFILL_CHUNK, 1, 500]


Run = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # chunk -> (outputs, states)


def step(lens: list[int], state_shape: tuple[int, ...], like: torch.Tensor,
         scan: Callable[[torch.Tensor, StepItems, torch.Tensor, int], None]) -> Run:
    """One step of fresh items, one per slot, through `scan(states, items, out, chunk)`."""
    items = StepItems.make(lens, list(range(len(lens))), [True] * len(lens), like.device)
    states, out = torch.empty(len(lens), *state_shape, device=like.device), torch.empty_like(like)  # never read

    def run(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        scan(states, items, out, chunk)
        return out, states

    return run


def delta_step(lens: list[int], device: torch.device) -> Run:
    tokens, heads, dk, dv = sum(lens), DELTA["heads"], DELTA["dk"], DELTA["dv"]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, device=device, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, device=device, generator=gen), dim=-1)
    v = torch.randn(tokens, heads, dv, device=device, generator=gen)
    beta = torch.rand(tokens, heads, device=device, generator=gen)
    decay = torch.rand(tokens, heads, device=device, generator=gen) * 0.1 + 0.9
    return step(lens, (heads, dk, dv), v, partial(gated_delta_rule, q, k, v, beta, decay))


def mamba_step(lens: list[int], device: torch.device) -> Run:
    tokens, heads, groups, p, n = sum(lens), MAMBA["heads"], MAMBA["groups"], MAMBA["p"], MAMBA["n"]
    gen = torch.Generator(device=device).manual_seed(0)
    xs = torch.randn(tokens, heads, p, device=device, generator=gen)
    dt = torch.rand(tokens, heads, device=device, generator=gen) * 0.1
    decay = -dt * torch.rand(heads, device=device, generator=gen)
    b, c = (torch.randn(tokens, groups, n, device=device, generator=gen) for _ in range(2))
    return step(lens, (heads, p, n), xs, partial(mamba2_scan, xs, dt, decay, b, c))


def correctness(device: torch.device) -> bool:
    ok = True
    for name, make in (("delta rule", delta_step), ("mamba2", mamba_step)):
        for lens in ([4096], MIXED):
            run = make(lens, device)
            out, states = (t.clone() for t in run(PREFILL_CHUNK))  # run(0) reuses the buffers
            want_out, want_states = run(0)
            for what, got, want in (("out", out, want_out), ("states", states, want_states)):
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                good = err <= 1e-4
                ok &= good
                print(f"  {'ok  ' if good else 'FAIL'} {name} {lens} {what}: max relative difference {err:.3g}")
    return ok


def compiled(kernel: object) -> list[dict[str, int]]:
    found = []
    for caches in kernel.device_caches.values():  # type: ignore[attr-defined]
        for binary in caches[0].values():
            found.append({"registers": getattr(binary, "n_regs", -1), "spilled_bytes": getattr(binary, "n_spills", -1)})
    return found


def timing(device: torch.device) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, make in (("delta rule", delta_step), ("mamba2", mamba_step)):
        for lens in ([4096], [512] * 8):
            run = make(lens, device)
            ms = {chunk: triton.testing.do_bench(partial(run, chunk), warmup=5, rep=50) for chunk in (PREFILL_CHUNK, 0)}
            row = {"scan": name, "items": lens, "chunked_ms": ms[PREFILL_CHUNK], "token_by_token_ms": ms[0],
                   "chunked_tokens_per_s": sum(lens) / ms[PREFILL_CHUNK] * 1e3, "speedup": ms[0] / ms[PREFILL_CHUNK]}
            rows.append(row)
            print(f"  {name:10} {len(lens)} x {lens[0]:5} tokens: chunked {ms[PREFILL_CHUNK]:8.3f} ms, token by token "
                  f"{ms[0]:8.3f} ms ({row['speedup']:.1f}x)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("recurrent_check: no CUDA device")
        return 1
    device = torch.device("cuda")
    print(f"the chunked form ({PREFILL_CHUNK}-token chunks) against token by token:")
    ok = correctness(device)
    rows = timing(device)
    kernels = {k.fn.__name__: compiled(k) for k in (recurrent._delta_rule_kernel, recurrent._mamba2_kernel)}
    print(f"compiled (registers, spilled bytes): {kernels}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "correct": ok, "chunk": PREFILL_CHUNK,
                       "rows": rows, "kernels": kernels}, f, indent=1)
    print(f"recurrent_check: {'correct' if ok else 'INCORRECT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
