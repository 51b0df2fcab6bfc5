"""The CPU extension's elementwise ops (`csrc/elementwise.cpp`), which the Python layers
(`model/ops.py CpuKernelOps`) and the compiled step share: residual add + RMSNorm and SiLU-and-mul
against torch's forms (`TorchOps`), a row's result independent of the rows beside it and of the
thread count, the rounding steps of the model's dtype, and bad input refused."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.kernels import cpu_extension
from radixserve.model.ops import CpuKernelOps, TorchOps, make_ops

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    cpu_extension.load_extension()


def _rows(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 17), (40, 64), (1, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_torchs_norm_to_rounding(dtype: torch.dtype, rows: int, dim: int, with_residual: bool) -> None:
    """The new residual is x + residual in the dtype, exactly; the normed rows differ from TorchOps'
    only by the order of the sum of squares (fp32: a few ulps; bf16/fp16: at most one ulp of the
    dtype, from the normed value's rounding)."""
    x, weight = _rows(rows, dim, dtype, seed=dim), _rows(1, dim, dtype, seed=dim + 1)[0]
    residual = _rows(rows, dim, dtype, seed=dim + 2) if with_residual else None
    got, got_residual = CpuKernelOps().add_rms_norm(x, residual, weight, 1e-6)
    want, want_residual = TorchOps().add_rms_norm(x, residual, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got_residual, want_residual)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 * ulp + 1e-3).all()


def test_a_rows_norm_and_activation_do_not_depend_on_the_rows_beside_it_or_the_threads() -> None:
    """Bit for bit: a row alone, among 2..600 rows (past a parallel task's share), on one thread or two."""
    x, residual, weight = _rows(600, 576, torch.float32, 1), _rows(600, 576, torch.float32, 2), _rows(1, 576,
                                                                                                        torch.float32, 3)[0]
    gate_up = _rows(600, 2 * 1536, torch.float32, 4)
    norm, act = torch.ops.radixserve.add_rms_norm, torch.ops.radixserve.silu_and_mul
    alone = [norm(x[i:i + 1], residual[i:i + 1], weight, 1e-5)[0] for i in (0, 7, 599)]
    acts = [act(gate_up[i:i + 1]) for i in (0, 7, 599)]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            many, _ = norm(x, residual, weight, 1e-5)
            activated = act(gate_up)
            for row, (one, one_act) in zip((0, 7, 599), zip(alone, acts)):
                assert torch.equal(many[row:row + 1], one) and torch.equal(activated[row:row + 1], one_act)
            assert torch.equal(norm(x[:2], residual[:2], weight, 1e-5)[0][:1], alone[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_torchs_to_rounding(dtype: torch.dtype) -> None:
    """fp32: within 1e-6 relative of torch's silu(gate) * up; bf16: SiLU rounded to bf16 before the
    product, as torch's two ops round (at most one bf16 ulp apart, from SiLU's last fp32 bit)."""
    gate_up = torch.cat([_rows(5, 2 * 100, torch.float32, 5), torch.linspace(-120, 120, 200).reshape(1, 200)])
    gate_up = gate_up.to(dtype)
    got = CpuKernelOps().silu_and_mul(gate_up)
    want = TorchOps().silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (6, 100)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()


def test_silu_at_the_edges_of_the_exponential() -> None:
    """No overflow from e^-x: large gates pass through, very negative ones (and -inf) give 0, +inf
    stays inf and NaN stays NaN, as torch's SiLU gives them."""
    gate = torch.tensor([80.0, 100.0, -80.0, -100.0, float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1e-30])
    got = torch.ops.radixserve.silu_and_mul(torch.cat([gate, torch.ones_like(gate)]))
    want = torch.nn.functional.silu(gate)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-30)


def test_empty_rows_give_empty_results() -> None:
    norm, act = torch.ops.radixserve.add_rms_norm, torch.ops.radixserve.silu_and_mul
    out, residual = norm(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8), 1e-6)
    assert out.shape == residual.shape == (0, 8)
    assert norm(torch.empty(3, 0), None, torch.ones(0), 1e-6)[0].shape == (3, 0)
    assert act(torch.empty(0, 8)).shape == (0, 4) and act(torch.empty(2, 0)).shape == (2, 0)


def test_cpu_kernel_ops_go_with_the_extensions_projections() -> None:
    assert make_ops("torch", cpu_kernels=True).name == "cpp"
    assert make_ops("torch").name == "torch"
    assert make_ops("triton", cpu_kernels=True).name == "triton"


def test_bad_elementwise_inputs_are_refused_with_a_reason() -> None:
    norm, act = torch.ops.radixserve.add_rms_norm, torch.ops.radixserve.silu_and_mul
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="a weight of 8 values in x's dtype"):
        norm(x, None, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="a weight of 8 values in x's dtype"):
        norm(x, None, torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="a residual like x"):
        norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="gate and up side by side"):
        act(torch.randn(2, 7))
    # CpuKernelOps leaves what the ops do not take to torch's forms: a weight of another dtype
    mixed, _ = CpuKernelOps().add_rms_norm(x.bfloat16(), None, torch.ones(8), 1e-6)
    assert mixed.dtype == torch.float32  # torch's promotion, as TorchOps gives it
