"""Test-suite setup: Triton runs on CPU only under its interpreter, which must be chosen before import."""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine a test builds checks the cache state's invariants after each of its steps
os.environ.setdefault("RADIXSERVE_CHECK_INTEGRITY", "1")

if os.environ["TRITON_INTERPRET"] == "1" and importlib.util.find_spec("triton") is not None:
    import numpy as np
    from triton.runtime import interpreter

    _create_dot = interpreter.InterpreterBuilder.create_dot

    def _row_stable_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        """The interpreter's tl.dot, each output element summed over k in one fixed order. Its own
        np.matmul calls BLAS, whose AVX2 kernels (OpenBLAS on Haswell or Zen) sum a tile's rows in
        groups of six, each group in another order: a row's bits would depend on where in its tile it
        sits, which no GPU does, and the kernels' alone-or-among-others tests would fail on such a CPU."""
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8: converted there
        summed = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)  # no BLAS: k in order
        return interpreter.TensorHandle(summed + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = _row_stable_dot  # type: ignore[method-assign]

# RADIXSERVE_TEST_OVERLAP=1 runs every engine the suite builds with overlap scheduling (launch step N,
# then commit step N-1), which CPU engines leave off by default; RADIXSERVE_TEST_EAGER=1 turns the
# padded decode path off (`enforce_eager`), so every batch takes the eager path. The suite passes
# under each (config fields a test sets itself are left as it set them).
_OVERLAP = os.environ.get("RADIXSERVE_TEST_OVERLAP") == "1"
_EAGER = os.environ.get("RADIXSERVE_TEST_EAGER") == "1"
if _OVERLAP or _EAGER:
    from radixserve.config import EngineConfig

    _post_init = EngineConfig.__post_init__

    def _test_defaults(self: EngineConfig) -> None:
        if _OVERLAP and self.overlap is None:
            self.overlap = True
        if _EAGER:
            self.enforce_eager = True
        _post_init(self)

    EngineConfig.__post_init__ = _test_defaults  # type: ignore[method-assign]
