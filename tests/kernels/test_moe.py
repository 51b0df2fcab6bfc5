"""The routed experts (`kernels.moe`): the activations against their formulas, the C++ CPU kernel
(`radixserve::moe_experts`) and the Triton kernels (`kernels.fused_moe`, under TRITON_INTERPRET=1 as
set by conftest.py) against the plain-torch reference in float64, and batch invariance: a token's
result is the same, bit for bit, alone or among others, on one thread or two.

Experts that no token routes to hold NaN weights, so reading one anywhere shows up as NaN. Shapes are
odd on purpose: a hidden size that is no multiple of 32 and an intermediate size no multiple of 16
(the C++ kernel's padded tiles), and no multiple of the Triton tiles either (their masks). Ungated
experts (relu2: up rows only) run every check the gated ones do.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.kernels import cpu_extension
from radixserve.kernels.moe import (
    EXPERT_ACTIVATIONS,
    ExpertActivation,
    ExpertWeights,
    PackedExperts,
    cpu_kernel_available,
    prepare,
    routed_experts,
    routed_experts_reference,
)

ROOT = Path(__file__).resolve().parents[2]
F32, BF16 = torch.float32, torch.bfloat16
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler")


def _case(dtype: torch.dtype, tokens: int, *, experts: int = 7, unrouted: int = 2, hidden: int = 72,
          inter: int = 40, top_k: int = 3, bias: bool = False, seed: int = 0, gated: bool = True):
    """Weights, x, topk_ids and topk_weights; the last `unrouted` experts get no token and NaN weights.
    Ungated experts have up rows only."""
    g = torch.Generator().manual_seed(seed)
    scale = 1 / math.sqrt(hidden)

    def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    rows = 2 * inter if gated else inter
    weights = ExpertWeights(randn(experts, rows, hidden, s=2 * scale), randn(experts, hidden, inter, s=scale),
                            randn(experts, rows, s=0.5) if bias else None, randn(experts, hidden) if bias else None)
    for stack in (weights.gate_up, weights.down, weights.gate_up_bias, weights.down_bias):
        if stack is not None and unrouted:
            stack[experts - unrouted:] = float("nan")
    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts - unrouted, generator=g)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=g)
    return weights, x, ids, topk_weights


def _float64_reference(x, ids, topk_weights, weights: ExpertWeights, activation: ExpertActivation) -> torch.Tensor:
    return routed_experts_reference(x.double(), ids, topk_weights.double(), weights.map(torch.Tensor.double),
                                    activation)


# ---------------------------------------------------------------- the activations


def test_gated_activations_are_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 64, generator=g, dtype=torch.float64) * 6  # well past the clamp limits
    gate, up = gate_up[:, :32], gate_up[:, 32:]
    torch.testing.assert_close(ExpertActivation("silu")(gate_up), gate * torch.sigmoid(gate) * up)
    tanh = torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))
    torch.testing.assert_close(ExpertActivation("gelu_tanh")(gate_up), 0.5 * gate * (1 + tanh) * up)
    alpha, limit = 1.5, 3.0
    clamped_gate, clamped_up = gate.clamp(max=limit), up.clamp(-limit, limit)
    torch.testing.assert_close(ExpertActivation("clamped_swiglu", alpha=alpha, limit=limit)(gate_up),
                               clamped_gate * torch.sigmoid(clamped_gate * alpha) * (clamped_up + 1))
    assert (gate > limit).any() and (up.abs() > limit).any()
    assert ExpertActivation("relu2")(gate_up).shape == gate_up.shape and not ExpertActivation("relu2").gated
    torch.testing.assert_close(ExpertActivation("relu2")(gate_up), gate_up.clamp(min=0) ** 2)
    with pytest.raises(ValueError, match="unknown expert activation"):
        ExpertActivation("relu")


def test_the_reference_reads_only_routed_experts_and_sums_in_k_order() -> None:
    """One token, written out by hand: Σ_j w_j · down_j(act(gate_up_j x)) in j order."""
    weights, x, ids, topk_weights = _case(F32, 1, bias=True)
    activation = ExpertActivation("silu")
    want = torch.zeros(x.shape[1])
    for j in range(ids.shape[1]):
        e = int(ids[0, j])
        h = activation(weights.gate_up[e] @ x[0] + weights.gate_up_bias[e])
        want = want + (weights.down[e] @ h + weights.down_bias[e]) * topk_weights[0, j]
    torch.testing.assert_close(routed_experts_reference(x, ids, topk_weights, weights, activation)[0], want)


# ---------------------------------------------------------------- the C++ kernel


@pytest.fixture(scope="module")
def extension() -> None:
    cpu_extension.load_extension()


@needs_compiler
@pytest.mark.usefixtures("extension")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_kernel_is_the_reference(dtype: torch.dtype, kind: str, bias: bool) -> None:
    """To fp32 rounding against float64; bf16: the fp32 sum rounded once (within one bf16 ulp)."""
    activation = ExpertActivation(kind, alpha=1.702, limit=1.0)  # a low limit: both clamps bite
    for tokens in (1, 4, 20):
        weights, x, ids, topk_weights = _case(dtype, tokens, bias=bias, seed=tokens, gated=activation.gated)
        packed = prepare(weights, "cpu", gated=activation.gated)
        assert isinstance(packed, PackedExperts)
        got = routed_experts(x, ids, topk_weights, packed, activation)
        want = _float64_reference(x, ids, topk_weights, weights, activation)
        assert got.shape == x.shape and got.dtype == dtype
        if dtype == F32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        else:
            assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()


@needs_compiler
@pytest.mark.usefixtures("extension")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", ["clamped_swiglu", "relu2"])
def test_cpu_kernel_token_is_the_same_alone_or_among_others(dtype: torch.dtype, kind: str) -> None:
    """Bit for bit: each token alone, among 2..20 (register tiles of 6 rows and their tails), among 150
    routed to 3 experts (over 48 rows an expert: row chunks), from a strided x, on one thread or two."""
    activation = ExpertActivation(kind, limit=1.0)
    weights, x, ids, topk_weights = _case(dtype, 150, experts=4, unrouted=1, top_k=2, bias=True, seed=3,
                                          gated=activation.gated)
    packed = prepare(weights, "cpu", gated=activation.gated)

    def run(rows: slice, x_rows: torch.Tensor | None = None) -> torch.Tensor:
        return routed_experts(x[rows] if x_rows is None else x_rows, ids[rows], topk_weights[rows], packed, activation)

    alone = torch.cat([run(slice(i, i + 1)) for i in range(20)])
    for count in (2, 5, 6, 7, 13, 20):
        assert torch.equal(run(slice(0, count)), alone[:count]), count
    together = run(slice(None))
    assert torch.equal(together[:20], alone)
    wide = torch.cat([x, x], dim=1)[:, :x.shape[1]]
    assert torch.equal(run(slice(None), wide), together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(slice(None)), together)
        torch.set_num_threads(2)
        assert torch.equal(run(slice(None)), together)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
@pytest.mark.usefixtures("extension")
def test_cpu_kernel_takes_no_tokens_and_refuses_bad_ids() -> None:
    weights, x, ids, topk_weights = _case(F32, 3)
    packed = prepare(weights, "cpu")
    activation = ExpertActivation()
    assert routed_experts(x[:0], ids[:0], topk_weights[:0], packed, activation).shape == (0, x.shape[1])
    with pytest.raises(RuntimeError, match="outside"):
        routed_experts(x, ids + weights.num_experts, topk_weights, packed, activation)


@needs_compiler
@pytest.mark.usefixtures("extension")
def test_prepare_packs_only_what_the_kernel_runs() -> None:
    """fp32 and bf16 are packed once the extension is loaded; fp16, or a caller that says no (as under
    --enforce-eager), keeps the plain stacks and runs the reference."""
    assert cpu_kernel_available()
    activation = ExpertActivation()
    for dtype, use_cpu_kernel in ((torch.float16, True), (F32, False)):
        weights, x, ids, topk_weights = _case(dtype, 2, unrouted=0)
        plain = prepare(weights, "cpu", use_cpu_kernel=use_cpu_kernel)
        assert isinstance(plain, ExpertWeights)
        assert torch.equal(routed_experts(x, ids, topk_weights, plain, activation),
                           routed_experts_reference(x, ids, topk_weights, weights, activation))


# ---------------------------------------------------------------- the Triton kernels (interpreter)


def _assert_triton_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == F32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # bf16: the projections and the activation are rounded to bf16 before the down projection
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_kernels_are_the_reference(dtype: torch.dtype, kind: str, bias: bool) -> None:
    """Tiles of 32 (masks on both 72 and 40 columns); one token, a few and 20 (several blocks of 16
    rows for one expert); two experts get no token."""
    from radixserve.kernels.fused_moe import fused_experts

    activation = ExpertActivation(kind, alpha=1.702, limit=1.0)
    for tokens in (1, 7, 20):
        weights, x, ids, topk_weights = _case(dtype, tokens, bias=bias, seed=tokens, gated=activation.gated)
        got = fused_experts(x, ids, topk_weights, weights, activation, block_n=32, block_k=32)
        want = _float64_reference(x, ids, topk_weights, weights, activation)
        assert got.shape == x.shape and got.dtype == dtype
        _assert_triton_close(got, want)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_kernels_token_is_the_same_alone_or_among_others(dtype: torch.dtype) -> None:
    """Bit for bit, with the default tiles: no value of a token depends on the rows that share its tiles."""
    from radixserve.kernels.fused_moe import fused_experts

    weights, x, ids, topk_weights = _case(dtype, 20, experts=4, unrouted=1, top_k=2, bias=True, seed=5)
    activation = ExpertActivation("gelu_tanh")
    together = fused_experts(x, ids, topk_weights, weights, activation)
    alone = torch.cat([fused_experts(x[i:i + 1], ids[i:i + 1], topk_weights[i:i + 1], weights, activation)
                       for i in range(20)])
    assert torch.equal(together, alone)
    _assert_triton_close(together, _float64_reference(x, ids, topk_weights, weights, activation))


def test_route_groups_pairs_by_expert_in_whole_blocks() -> None:
    """Every pair once, in its expert's blocks, ascending within one; padding is the sentinel; blocks
    past the routed ones name no expert."""
    from radixserve.kernels.fused_moe import _route

    g = torch.Generator().manual_seed(0)
    experts, block_m = 9, 4
    ids = torch.randint(0, 6, (11, 3), generator=g)  # experts 6..8 get nothing
    sorted_pairs, block_expert = _route(ids, experts, block_m)
    flat, pairs = ids.reshape(-1), ids.numel()
    blocks = sorted_pairs.view(-1, block_m).long()
    seen: list[int] = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist(), strict=True):
        real = [p for p in block if p != pairs]
        if expert == experts:
            assert not real
            continue
        assert real and all(int(flat[p]) == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(pairs))
    assert seen == sorted(seen, key=lambda p: int(flat[p]))  # grouped by expert, ascending within


def test_triton_kernels_compile_for_hopper_with_tensor_cores() -> None:
    """A real sm_90 compile through aot_check's stand-in driver (launches do nothing): every
    activation, with and without biases, bf16 on tensor cores and fp32, within shared memory."""
    code = (
        "import torch\n"
        "from radixserve.kernels.aot_check import _compiled, stand_in_gpu\n"
        "from radixserve.kernels import fused_moe\n"
        "from radixserve.kernels.moe import EXPERT_ACTIVATIONS, ExpertActivation, ExpertWeights\n"
        "kernels = (fused_moe._gate_up_kernel, fused_moe._down_kernel, fused_moe._sum_pairs_kernel)\n"
        "with stand_in_gpu(90):\n"
        "    for kernel in kernels:\n"
        "        kernel.device_caches.clear()\n"
        "    for dtype, kind, bias in [(torch.bfloat16, kind, kind == 'clamped_swiglu') for kind in EXPERT_ACTIVATIONS]"
        " + [(torch.float32, 'silu', False)]:\n"
        "        e, h, i = 8, 576, 200\n"
        "        r = 2 * i if ExpertActivation(kind).gated else i\n"
        "        w = ExpertWeights(*(torch.zeros(*shape, dtype=dtype) for shape in ((e, r, h), (e, h, i))),\n"
        "                          *((torch.zeros(e, r, dtype=dtype), torch.zeros(e, h, dtype=dtype)) if bias"
        " else ()))\n"
        "        fused_moe.fused_experts(torch.zeros(3, h, dtype=dtype), torch.tensor([[0, 1], [2, 3], [0, 5]]),\n"
        "                                torch.ones(3, 2), w, ExpertActivation(kind))\n"
        "    for kernel in kernels:\n"
        "        for v in _compiled(kernel):\n"
        "            print(v.kernel, v.fits, v.tensor_cores)\n"
    )
    proc = _run_without_interpreter(code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert all(fits == "True" for _, fits, _ in rows), rows
    compiled = [name for name, _, _ in rows]
    assert compiled.count("_gate_up_kernel") == 5 and compiled.count("_down_kernel") == 3, rows  # down: bias or not
    assert sum(mma == "True" for name, _, mma in rows if name == "_gate_up_kernel") == 4  # bf16 on tensor cores


def _run_without_interpreter(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)
