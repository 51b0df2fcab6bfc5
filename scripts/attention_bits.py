"""Does a change to the CPU attention kernel keep its bits? Runs `radixserve::paged_attention` (the
extension built from this checkout) on a fixed set of random cases and writes every output, or compares
two such files bit for bit (outputs as integers: a zero's sign and a NaN's payload count).

The cases cover what the kernel's variants and layouts take: fp32, fp16 and bf16 caches; head dims 32
to 128; blocks of 8 to 32 tokens over a shuffled pool; 1 to 4 rows of 1 to 40 new tokens; sliding
windows, attention sinks, logit softcaps and NaN keys.

    git stash; python scripts/attention_bits.py --write /tmp/before.pt; git stash pop
    python scripts/attention_bits.py --write /tmp/after.pt
    python scripts/attention_bits.py --compare /tmp/before.pt /tmp/after.pt
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from radixserve.kernels.cpu_extension import load_extension


def case_outputs(cases: int, seed: int = 0) -> list[torch.Tensor]:
    """The kernel's output for each of `cases` random cases (the same cases for the same seed)."""
    load_extension()
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    outputs = []
    for _ in range(cases):
        dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
        head_dim, kv_heads, group = rng.choice([64, 64, 128, 32]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
        block = rng.choice([16, 16, 8, 32])
        lengths = [rng.randint(1, 900) for _ in range(rng.randint(1, 4))]
        queries = [min(n, rng.choice([1, 1, 2, 5, 17, 40])) for n in lengths]
        row_blocks = [-(-n // block) for n in lengths]
        pool = sum(row_blocks) + 3
        k_cache = (torch.randn(pool, block, kv_heads, head_dim, generator=generator) * rng.choice([0.5, 3.0])).to(dtype)
        v_cache = torch.randn(pool, block, kv_heads, head_dim, generator=generator).to(dtype)
        if rng.random() < 0.05:
            k_cache[rng.randrange(pool), 0, 0, 0] = float("nan")
        order = iter(torch.randperm(pool, generator=generator).tolist())
        table = torch.zeros(len(lengths), max(row_blocks), dtype=torch.int32)
        for row, count in enumerate(row_blocks):
            for i in range(count):
                table[row, i] = next(order)
        q = torch.randn(sum(queries), kv_heads * group, head_dim, generator=generator) * 0.5
        window = rng.choice([0, 0, 0, 7, 100, 300])
        sinks = torch.randn(kv_heads * group, generator=generator) if rng.random() < 0.2 else None
        softcap = rng.choice([0.0, 0.0, 0.0, 30.0])
        out = torch.empty_like(q)
        torch.ops.radixserve.paged_attention(q, k_cache, v_cache, table, lengths, queries, 0.1, 2**62, out, window,
                                             sinks, softcap)
        outputs.append(out)
    return outputs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def differing(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[int]:
    """The cases whose outputs differ in any bit."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} cases against {len(after)}")
    return [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(_bits(a), _bits(b))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="FILE", help="run the cases and save their outputs here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two saved runs, bit for bit")
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args(argv)
    if args.write:
        outputs = case_outputs(args.cases)
        torch.save(outputs, args.write)
        print(f"{len(outputs)} cases, {sum(bool(o.isnan().any()) for o in outputs)} with NaN outputs: {args.write}")
    if args.compare:
        before, after = (torch.load(path) for path in args.compare)
        bad = differing(before, after)
        print(f"{len(before)} cases: " + (f"{len(bad)} differ: {bad}" if bad else "every output the same, bit for bit"))
        return 1 if bad else 0
    if not (args.write or args.compare):
        parser.error("--write FILE or --compare BEFORE AFTER")
    return 0


if __name__ == "__main__":
    sys.exit(main())
