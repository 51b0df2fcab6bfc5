"""Test-suite setup: Triton runs on CPU only under its interpreter, which must be chosen before import."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine a test builds checks the cache state's invariants after each of its steps
os.environ.setdefault("RADIXSERVE_CHECK_INTEGRITY", "1")

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
