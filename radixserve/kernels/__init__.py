"""The kernels: Triton paged attention and fused decode ops, the C++ CPU kernels, the FP8 row format.

Triton public API (fixed): `paged_decode_attention`, `paged_extend_attention`, `store_kv`, and the fused
decode-path kernels `add_rms_norm`, `rotary_qk_`, `silu_and_mul` (`fused.py`); plain-torch references in
`reference.py`. Cache layout [num_blocks, block_size, Hkv, D] (see radixserve/model/kv_cache.py). The C++
CPU kernels live in `csrc/`, built and loaded by `cpu_extension.py`; `cpu_linear.py` wraps the matmul.
The FP8 row format (`fp8_format.py`) is shared by the Triton kernels and the CPU path.

The Triton exports load lazily so that `import radixserve.kernels` stays cheap and never imports triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "add_rms_norm": "radixserve.kernels.fused",
    "paged_decode_attention": "radixserve.kernels.decode",
    "paged_extend_attention": "radixserve.kernels.extend",
    "rotary_qk_": "radixserve.kernels.fused",
    "silu_and_mul": "radixserve.kernels.fused",
    "store_kv": "radixserve.kernels.kv_store",
}

__all__ = [
    "add_rms_norm",
    "paged_decode_attention",
    "paged_extend_attention",
    "rotary_qk_",
    "silu_and_mul",
    "store_kv",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
