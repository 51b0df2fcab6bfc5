"""The int8-activation path of the GGUF matmul (llama.cpp's way: each row quantized to 8 bits per
block of 32, integer dot products, one fp32 multiply-add per sub-block): equal, bit for bit, to the
numpy emulation in ggml_blocks.py for every format, whatever the row or thread count, in a
fused weight of mixed formats, and close to the fp32 product."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from ggml_blocks import int8_linear, quantize_rows, random_blocks, reference

from radixserve.kernels import cpu_extension
from radixserve.kernels.ggml_quants import ACTIVATIONS, FORMATS, SUPPORTED_TYPES, pack_ggml, packed_activations

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

ROW_COUNTS = [1, 2, 3, 4, 5, 9, 48, 50, 97]


@pytest.fixture(scope="module", autouse=True)
def _extension() -> None:
    cpu_extension.load_extension()


def _rows(count: int, in_features: int, seed: int) -> torch.Tensor:
    x = torch.randn(count, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros with d = 0
    x[1 % count, 32:64] *= 1e4  # an outlier block beside ordinary ones
    x[2 % count, :32] *= 1e-40  # subnormal: 127 / max |x| overflows, the block counts as zero
    return x


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_linear_is_the_reference_bit_for_bit_whatever_the_rows(name: str, threads: int) -> None:
    in_features, out_features = 2 * max(FORMATS[name].group, 64), 83
    raw = random_blocks(name, out_features, in_features, seed=2)
    packed = pack_ggml([(name, raw)], in_features)
    assert packed_activations(packed) == "int8"
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(3))
    x = _rows(max(ROW_COUNTS), in_features, seed=4)
    want = torch.from_numpy(int8_linear(x.numpy(), [(name, raw)], in_features, bias.numpy()))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROW_COUNTS:
            got = torch.ops.radixserve.linear(x[:rows], packed, bias, out_features)
            assert torch.equal(got.view(torch.int32), want[:rows].view(torch.int32)), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("fill", [0xFF, 0x7F, 0x80, 0x77])
def test_the_largest_quants_times_the_largest_inputs_are_counted_exactly(name: str, fill: int) -> None:
    """Every quant byte set alike (0x7F: Q8_0's largest, 127; 0x80: its smallest; 0xFF: the nibble
    formats' largest; 0x77: MXFP4's largest) against inputs that all round to +-127: the products an
    8-bit multiply adding pairs into 16 bits would saturate on (AVX2's vpmaddubsw) if it took them."""
    in_features = 2 * FORMATS[name].group
    raw = random_blocks(name, 16, in_features, seed=18).reshape(16, -1, FORMATS[name].block_bytes)
    for start, width, kind in FORMATS[name].fields:
        if kind == "columns":
            raw[..., start:start + width] = fill
    raw = raw.reshape(16, -1)
    x = torch.ones(3, in_features)
    x[1] = -1.0
    x[2, 1::2] = -1.0  # the pairs' products of opposite signs
    got = torch.ops.radixserve.linear(x, pack_ggml([(name, raw)], in_features), None, 16)
    assert torch.equal(got, torch.from_numpy(int8_linear(x.numpy(), [(name, raw)], in_features)))


def test_a_fused_weight_of_mixed_formats_takes_int8_inputs_part_by_part() -> None:
    in_features = 256
    parts = [("Q4_K", random_blocks("Q4_K", 32, in_features, 5)), ("Q6_K", random_blocks("Q6_K", 16, in_features, 7)),
             ("Q5_K", random_blocks("Q5_K", 16, in_features, 6)), ("Q8_0", random_blocks("Q8_0", 16, in_features, 8)),
             ("Q4_1", random_blocks("Q4_1", 16, in_features, 9)), ("Q4_0", random_blocks("Q4_0", 9, in_features, 10))]
    packed = pack_ggml(parts, in_features)
    x = _rows(7, in_features, seed=11)
    want = torch.from_numpy(int8_linear(x.numpy(), parts, in_features))
    for rows in (1, 2, 7):
        assert torch.equal(torch.ops.radixserve.linear(x[:rows], packed, None, 105), want[:rows])


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_int8_activations_stay_close_to_the_fp32_product(name: str) -> None:
    """8-bit inputs per block of 32 lose at most half a step of max|x| / 127 per input."""
    in_features = 2 * FORMATS[name].group
    raw = random_blocks(name, 40, in_features, seed=12)
    weight = reference(name, raw, in_features).double()
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(13))
    got = torch.ops.radixserve.linear(x, pack_ggml([(name, raw)], in_features), None, 40).double()
    step = x.reshape(5, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1).double() / 127
    bound = (step / 2) @ weight.abs().T * 1.01 + 1e-4 * (x.double().abs() @ weight.abs().T)
    assert ((got - x.double() @ weight.T).abs() <= bound).all()


def test_the_row_quantization_rounds_half_to_even_and_scales_in_fp16() -> None:
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]
    q, d = quantize_rows(x)
    assert q[0, :4].tolist() == [127, 0, 2, -2] and d[0, 0] == 1.0
    parts = [("Q8_0", random_blocks("Q8_0", 16, 32, seed=14))]
    got = torch.ops.radixserve.linear(torch.from_numpy(x), pack_ggml(parts, 32), None, 16)
    assert torch.equal(got, torch.from_numpy(int8_linear(x, parts, 32)))


def test_a_bad_activations_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="choose float32 or int8"):
        pack_ggml([("Q4_0", random_blocks("Q4_0", 16, 32, seed=15))], 32, activations="int4")
    packed = pack_ggml([("Q4_0", random_blocks("Q4_0", 16, 32, seed=15))], 32)
    damaged = packed.clone()
    damaged[24] = 7
    with pytest.raises(RuntimeError, match="bad header"):
        torch.ops.radixserve.linear(torch.randn(1, 32), damaged, None, 16)


def test_the_engine_offers_the_activations_the_kernel_packs() -> None:
    from radixserve.config import QUANTIZED_ACTIVATIONS, EngineConfig

    assert sorted(QUANTIZED_ACTIVATIONS) == sorted(ACTIVATIONS)
    with pytest.raises(ValueError, match="quantized_activations"):
        EngineConfig(quantized_activations="int4")


def test_a_non_finite_input_makes_its_row_nan_as_the_fp32_path_would() -> None:
    raw = random_blocks("Q4_1", 16, 64, seed=16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(17))
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    got = torch.ops.radixserve.linear(x, pack_ggml([("Q4_1", raw)], 64), None, 16)
    assert got[0].isfinite().all() and got[1:].isnan().all()
    assert torch.equal(got[0], torch.from_numpy(int8_linear(x[:1].numpy(), [("Q4_1", raw)], 64))[0])
