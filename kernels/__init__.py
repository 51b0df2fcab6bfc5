"""Triton paged-attention kernels over the block cache, with plain-torch references.

Public API (fixed): `paged_decode_attention`, `paged_extend_attention`, `store_kv`, and the fused
decode-path kernels `add_rms_norm`, `rotary_qk_`, `silu_and_mul` (kernels/fused.py); references in
`kernels.reference`. Cache layout [num_blocks, block_size, Hkv, D] (see radixserve/kv_cache.py).

The exports load lazily so that `import kernels` stays cheap and never imports triton: an unrelated
PyPI distribution is also imported as `kernels`, and transformers may import whatever `kernels` it
finds just to read a version. This package deliberately has no `__version__`, so that probe
(`is_kernels_available`) reports False instead of mistaking us for it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "add_rms_norm": "kernels.fused",
    "paged_decode_attention": "kernels.decode",
    "paged_extend_attention": "kernels.extend",
    "rotary_qk_": "kernels.fused",
    "silu_and_mul": "kernels.fused",
    "store_kv": "kernels.kv_store",
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
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
