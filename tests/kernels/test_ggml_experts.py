"""A GGUF file's MoE experts kept in their blocks (`kernels/moe.py::GgmlExperts`): with float32 activations
each routed expert is the fp32 kernel over its dequantized weights, so the experts' weighted sum is the
torch reference's over the dequantized stack (up to the matmuls' summation order), and a token's result
is the same bit for bit alone or among others, with int8 activations too."""

from __future__ import annotations

import shutil

import pytest
import torch
from ggml_blocks import random_blocks, reference

from radixserve.kernels import cpu_extension
from radixserve.kernels.ggml_quants import pack_ggml
from radixserve.kernels.moe import ExpertActivation, ExpertWeights, GgmlExperts, routed_experts, routed_experts_reference

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

EXPERTS, WIDTH, INTER, TOP_K = 4, 256, 64, 2


@pytest.fixture(scope="module", autouse=True)
def _extension() -> None:
    cpu_extension.load_extension()


def _experts(activations: str) -> tuple[GgmlExperts, ExpertWeights]:
    gate_up, down, stacked_gate_up, stacked_down = [], [], [], []
    for e in range(EXPERTS):
        gate, up = random_blocks("Q4_K", INTER, WIDTH, seed=10 + e), random_blocks("Q4_1", INTER, WIDTH, seed=20 + e)
        gate_up.append(pack_ggml([("Q4_K", gate), ("Q4_1", up)], WIDTH, activations))
        stacked_gate_up.append(torch.cat([reference("Q4_K", gate, WIDTH), reference("Q4_1", up, WIDTH)]))
        down_raw = random_blocks("Q8_0", WIDTH, INTER, seed=30 + e)
        down.append(pack_ggml([("Q8_0", down_raw)], INTER, activations))
        stacked_down.append(reference("Q8_0", down_raw, INTER))
    return (GgmlExperts(gate_up, down, 2 * INTER, WIDTH),
            ExpertWeights(torch.stack(stacked_gate_up), torch.stack(stacked_down)))


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, WIDTH, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)
    return x, ids, weights


def test_float32_experts_are_the_reference_over_their_dequantized_weights() -> None:
    experts, stacked = _experts("float32")
    x, ids, weights = _routing(9, seed=1)
    got = routed_experts(x, ids, weights, experts, ExpertActivation("silu"))
    exact = routed_experts_reference(x.double(), ids, weights.double(), ExpertWeights(
        stacked.gate_up.double(), stacked.down.double()), ExpertActivation("silu"))
    torch_fp32 = routed_experts_reference(x, ids, weights, stacked, ExpertActivation("silu"))
    # within fp32 rounding of the float64 result, as close as torch's own fp32 matmuls come
    bound = 1e-5 * exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= max(bound, 2 * (torch_fp32.double() - exact).abs().max().item())


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_tokens_result_does_not_depend_on_its_neighbours(activations: str) -> None:
    experts, _ = _experts(activations)
    x, ids, weights = _routing(13, seed=2)
    together = routed_experts(x, ids, weights, experts, ExpertActivation("silu"))
    for t in (0, 5, 12):
        alone = routed_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], experts, ExpertActivation("silu"))
        assert torch.equal(alone[0], together[t])
