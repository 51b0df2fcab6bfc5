"""The MXFP4 routed experts (`kernels.fused_moe_mxfp4`, under TRITON_INTERPRET=1 as set by conftest.py):
bit for bit what `fused_moe.fused_experts` computes on the dequantized experts (the decoded weights are
exact, the tiles the same), and close to the plain-torch reference; the format's decoding against its
definition. Hidden and intermediate sizes are multiples of 32 (the format's block) but not of the
kernels' 64-wide tiles; the last expert is routed to by no token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.kernels.fused_moe import fused_experts
from radixserve.kernels.fused_moe_mxfp4 import fused_experts_mxfp4
from radixserve.kernels.moe import ACTIVATIONS, ExpertActivation, routed_experts_reference
from radixserve.kernels.mxfp4_format import FP4_E2M1, Mxfp4Experts, dequantize_mxfp4

ROOT = Path(__file__).resolve().parents[2]


def _experts(dtype: torch.dtype, experts: int = 5, hidden: int = 96, inter: int = 32, bias: bool = True,
             seed: int = 0) -> Mxfp4Experts:
    g = torch.Generator().manual_seed(seed)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g).to(torch.uint8)

    def scales(*shape: int) -> torch.Tensor:  # 2^-9 .. 2^-4: outputs of order one
        return torch.randint(118, 124, shape, generator=g).to(torch.uint8)

    biases = ((torch.randn(experts, 2 * inter, generator=g) * 0.1).to(dtype),
              (torch.randn(experts, hidden, generator=g) * 0.1).to(dtype)) if bias else (None, None)
    return Mxfp4Experts(codes(experts, 2 * inter, hidden // 32, 16), scales(experts, 2 * inter, hidden // 32),
                        codes(experts, hidden, inter // 32, 16), scales(experts, hidden, inter // 32), *biases)


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_equals_fused_experts_on_the_dequantized_weights(dtype, activation):
    experts = _experts(dtype, bias=activation == "clamped_swiglu")
    x = torch.randn(7, experts.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids, weights = _routing(7, experts.num_experts, 2, seed=2)
    act = ExpertActivation(activation)
    got = fused_experts_mxfp4(x, ids, weights, experts, act)
    assert torch.equal(got, fused_experts(x, ids, weights, experts.dequantized(dtype), act))
    reference = routed_experts_reference(x.double(), ids, weights, experts.dequantized(torch.float64).map(
        lambda t: t.double()), act)
    largest = float(reference.abs().max())
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6  # bf16: rounded projections and activations
    torch.testing.assert_close(got.double(), reference, atol=tolerance * max(largest, 1.0), rtol=0)


def test_one_token_alone_or_among_others_bit_for_bit():
    experts = _experts(torch.bfloat16)
    x = torch.randn(9, experts.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    ids, weights = _routing(9, experts.num_experts, 3, seed=4)
    act = ExpertActivation("clamped_swiglu")
    batch = fused_experts_mxfp4(x, ids, weights, experts, act)
    alone = fused_experts_mxfp4(x[4:5], ids[4:5], weights[4:5], experts, act)
    assert torch.equal(batch[4:5], alone)


def test_decoding_follows_the_format():
    # low nibble first: byte 0x71 holds 0.5 then 6.0; e8m0 129 is 2^2; a sign bit (0x9 = -0.5)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 15] = 0x71, 0x9F
    scales = torch.tensor([[129]], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, scales)
    expected = torch.zeros(1, 32)
    expected[0, 0], expected[0, 1], expected[0, 30], expected[0, 31] = 2.0, 24.0, FP4_E2M1[15] * 4, FP4_E2M1[9] * 4
    assert torch.equal(values, expected)


def test_mismatched_stacks_are_refused():
    e = _experts(torch.float32)
    with pytest.raises(ValueError, match="down scales"):
        Mxfp4Experts(e.gate_up_blocks, e.gate_up_scales, e.down_blocks[:, :64], e.down_scales[:, :64])
    with pytest.raises(ValueError, match="not MXFP4"):
        Mxfp4Experts(e.gate_up_blocks.int(), e.gate_up_scales, e.down_blocks, e.down_scales)
    with pytest.raises(ValueError, match=r"x must be .* \[tokens, 96\]"):
        fused_experts_mxfp4(torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), e,
                            ExpertActivation("silu"))


def test_kernels_compile_for_hopper_with_tensor_cores():
    """A real sm_90 compile through aot_check's stand-in driver (launches do nothing): bf16 on tensor cores."""
    code = (
        "import torch\n"
        "from radixserve.kernels.aot_check import _compiled, stand_in_gpu\n"
        "from radixserve.kernels import fused_moe_mxfp4 as m\n"
        "from radixserve.kernels.moe import ExpertActivation\n"
        "from radixserve.kernels.mxfp4_format import Mxfp4Experts\n"
        "kernels = (m._gate_up_mxfp4_kernel, m._down_mxfp4_kernel)\n"
        "e, h, i = 8, 2880, 2880\n"
        "u8 = lambda *s: torch.zeros(*s, dtype=torch.uint8)\n"
        "experts = Mxfp4Experts(u8(e, 2 * i, h // 32, 16), u8(e, 2 * i, h // 32), u8(e, h, i // 32, 16),\n"
        "                       u8(e, h, i // 32), torch.zeros(e, 2 * i, dtype=torch.bfloat16),\n"
        "                       torch.zeros(e, h, dtype=torch.bfloat16))\n"
        "with stand_in_gpu(90):\n"
        "    for kernel in kernels:\n"
        "        kernel.device_caches.clear()\n"
        "    m.fused_experts_mxfp4(torch.zeros(3, h, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3], [0, 5]]),\n"
        "                          torch.ones(3, 2), experts, ExpertActivation('clamped_swiglu'))\n"
        "    for kernel in kernels:\n"
        "        for v in _compiled(kernel):\n"
        "            print(v.kernel, v.fits, v.tensor_cores)\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(line.split() for line in proc.stdout.splitlines())
    assert rows == [["_down_mxfp4_kernel", "True", "True"], ["_gate_up_mxfp4_kernel", "True", "True"]], rows
