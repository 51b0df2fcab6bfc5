"""Our top-level `kernels` package must not pass for Hugging Face's unrelated `kernels` distribution.

transformers probes `is_kernels_available()` (find_spec("kernels") plus a version in a narrow range)
and, if it says yes, imports `kernels.get_kernel` and friends. With radixserve on the path, the probe
finds our package; it must answer False and `import transformers` must keep working. Checked in a
fresh interpreter so no earlier import or lru_cache in this process colours the answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json
import transformers
from transformers.utils import import_utils
import transformers.integrations.hub_kernels  # imports `kernels` members if the probe says yes
spec = importlib.util.find_spec("kernels")
print(json.dumps({
    "available": import_utils.is_kernels_available(),
    "origin": spec.origin if spec else None,
}))
"""


def test_transformers_does_not_mistake_our_kernels_package():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the probe really looked at our package, not at nothing or at a different install
    assert result["origin"] is not None
    assert Path(result["origin"]).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    assert result["available"] is False


def test_importing_kernels_stays_light():
    """`import kernels` (what the probe may do) must not pull in triton."""
    code = "import sys, kernels; print('triton' in sys.modules, hasattr(kernels, '__version__'))"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False"]
