"""Test-suite setup: Triton runs on CPU only under its interpreter, which must be chosen before import."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine a test builds checks the cache state's invariants after each of its steps
os.environ.setdefault("RADIXSERVE_CHECK_INTEGRITY", "1")

# RADIXSERVE_TEST_OVERLAP=1 runs every engine the suite builds with overlap scheduling (launch step N,
# then commit step N-1), which CPU engines leave off by default: the whole suite passes either way.
if os.environ.get("RADIXSERVE_TEST_OVERLAP") == "1":
    from radixserve.config import EngineConfig

    _post_init = EngineConfig.__post_init__

    def _overlapped(self: EngineConfig) -> None:
        if self.overlap is None:
            self.overlap = True
        _post_init(self)

    EngineConfig.__post_init__ = _overlapped  # type: ignore[method-assign]
