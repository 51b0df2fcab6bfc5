"""Test-suite setup: Triton runs on CPU only under its interpreter, which must be chosen before import."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every engine a test builds checks the cache state's invariants after each of its steps
os.environ.setdefault("RADIXSERVE_CHECK_INTEGRITY", "1")
