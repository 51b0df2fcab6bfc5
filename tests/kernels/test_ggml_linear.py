"""The CPU matmul on GGUF's quantized blocks (`kernels/ggml_quants.py`, `csrc/ggml_formats.h`,
`csrc/linear.cpp`): every format decodes to gguf's own dequantization bit for bit, and `linear` over
a packed GGUF weight equals the fp32 kernel over that dequantized matrix bit for bit, whatever the
row count, the thread count, a bias or a fused weight of mixed formats; damaged input is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from ggml_blocks import random_blocks, reference
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from radixserve.kernels import cpu_extension
from radixserve.kernels.ggml_quants import (
    FORMATS,
    SUPPORTED_TYPES,
    QuantizedEmbedding,
    QuantizedLinear,
    pack_ggml,
    packed_types,
)
from radixserve.kernels.ggml_quants import dequantize as dequantize_packed

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

ROW_COUNTS = [1, 2, 3, 5, 6, 7, 13, 48, 50, 97]


@pytest.fixture(scope="module", autouse=True)
def _extension() -> None:
    cpu_extension.load_extension()


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.radixserve.linear(x, torch.ops.radixserve.pack_linear(weight), bias, weight.shape[0])


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_each_format_decodes_to_ggufs_dequantization_bit_for_bit(name: str) -> None:
    in_features = 2 * FORMATS[name].group
    raw = random_blocks(name, 37, in_features, seed=1)  # 37 rows: a last block of 5
    packed = pack_ggml([(name, raw)], in_features)
    assert torch.equal(dequantize_packed(packed, 37).view(torch.int32), reference(name, raw, in_features).view(torch.int32))
    assert packed_types(packed) == {name: 3}


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_is_the_fp32_kernel_on_the_dequantized_weight_whatever_the_rows(name: str, threads: int) -> None:
    in_features, out_features = 3 * FORMATS[name].group, 83
    raw = random_blocks(name, out_features, in_features, seed=2)
    weight = reference(name, raw, in_features)
    packed = pack_ggml([(name, raw)], in_features, activations="float32")
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(3))
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.stack([torch.ops.radixserve.linear(x[i:i + 1], packed, bias, out_features)[0]
                             for i in range(max(ROW_COUNTS))])
        for rows in ROW_COUNTS:
            got = torch.ops.radixserve.linear(x[:rows], packed, bias, out_features)
            assert torch.equal(got, fp32_linear(x[:rows], weight, bias)), rows
            assert torch.equal(got, alone[:rows]), rows
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ weight.double().T + bias.double()
    # fp32 summation's bound: in_features * 2^-24 of the sum of the terms' magnitudes, and a margin
    magnitude = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    assert ((alone.double() - exact).abs() <= 1e-4 * magnitude).all()


def test_a_fused_weight_packs_parts_of_different_formats() -> None:
    """A Q4_K_M file's q and k in Q4_K beside v in Q6_K: one weight, each part's rows as shipped."""
    in_features = 256
    parts = [("Q4_K", random_blocks("Q4_K", 32, in_features, 5)), ("Q4_K", random_blocks("Q4_K", 16, in_features, 6)),
             ("Q6_K", random_blocks("Q6_K", 16, in_features, 7)), ("Q8_0", random_blocks("Q8_0", 9, in_features, 8))]
    packed = pack_ggml(parts, in_features, activations="float32")
    weight = torch.cat([reference(name, raw, in_features) for name, raw in parts])
    assert packed_types(packed) == {"Q4_K": 3, "Q6_K": 1, "Q8_0": 1}
    assert torch.equal(dequantize_packed(packed, 73), weight)
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(9))
    for rows in (1, 2, 7):
        assert torch.equal(torch.ops.radixserve.linear(x[:rows], packed, None, 73), fp32_linear(x[:rows], weight))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_weights_quantized_by_gguf_compute_close_to_the_originals(name: str) -> None:
    """The path a real file takes: gguf's own quantizer, then the module a model holds."""
    g = torch.Generator().manual_seed(10)
    weight = torch.randn(40, 96, generator=g) * 0.05
    raw = quantize(weight.numpy(), GGMLQuantizationType[name])
    linear = QuantizedLinear(pack_ggml([(name, raw)], 96, activations="float32"), 40, 96)
    x = torch.randn(3, 2, 96, generator=g)
    got = linear(x)
    assert got.shape == (3, 2, 40)
    assert torch.equal(got.reshape(6, 40), fp32_linear(x.reshape(6, 96), reference(name, raw, 96)))
    tolerance = 0.02 if name == "Q8_0" else 0.2  # 8-bit vs 4-bit quants of N(0, 0.05) weights
    assert (got - x @ weight.T).abs().max() < tolerance * (x @ weight.T).abs().max()


def test_an_embedding_looks_up_dequantized_rows_and_shares_its_buffer_with_a_tied_head() -> None:
    raw = random_blocks("Q8_0", 50, 64, seed=11)
    embedding = QuantizedEmbedding(pack_ggml([("Q8_0", raw)], 64), 50, 64)
    head = QuantizedLinear(embedding.weight, 50, 64)
    ids = torch.tensor([[3, 3, 49], [0, 17, 16]])
    table = reference("Q8_0", raw, 64)
    assert torch.equal(embedding(ids), table[ids])
    assert head.weight is embedding.weight
    shared = torch.nn.ModuleList([embedding, head])
    assert sum(p.numel() for p in shared.parameters()) == embedding.weight.numel()


def test_bad_input_is_refused_with_its_reason() -> None:
    raw = random_blocks("Q4_0", 16, 64, seed=12)
    with pytest.raises(ValueError, match="Q2_K is not one the CPU kernels read"):
        pack_ggml([("Q2_K", raw)], 64)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        pack_ggml([("Q4_K", raw)], 64)
    with pytest.raises(ValueError, match="rows of 64 inputs are 36 bytes"):
        pack_ggml([("Q4_0", raw[:, :20])], 64)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        pack_ggml([("Q4_0", raw[:5]), ("Q8_0", random_blocks("Q8_0", 4, 64, seed=13))], 64)
    packed = pack_ggml([("Q4_0", raw)], 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bad magic"):
        damaged = packed.clone()
        damaged[0] ^= 1
        torch.ops.radixserve.linear(x, damaged, None, 16)
    with pytest.raises(RuntimeError, match="outside the buffer"):
        torch.ops.radixserve.linear(x, packed[:-1].clone(), None, 16)
    with pytest.raises(RuntimeError, match="x \\[rows, in\\] with in = 64"):
        torch.ops.radixserve.linear(torch.randn(2, 32), packed, None, 16)
    with pytest.raises(RuntimeError, match="outside the weight"):
        torch.ops.radixserve.ggml_rows(packed, torch.tensor([16]))
