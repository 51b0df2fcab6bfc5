"""The `bench` optional extra: serving imports none of its libraries (nor any benchmark module), and
`radixserve bench` without them says which extra to install and exits non-zero, without a traceback.

Each check runs in a fresh interpreter: this test session has imported the libraries already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from radixserve_bench.extra import BENCH_LIBRARIES, INSTALL_HINT

NEVER_SERVING = ("matplotlib", "chitchat_dataset")  # named by the issue, whatever the extra's list says

# imports what serving imports and parses `serve`'s flags, then prints which of the given top-level
# packages (and which benchmark modules) got imported
IMPORTED_BY_SERVING = """
import contextlib, io, json, sys
import radixserve.server.app, radixserve.cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    radixserve.cli.main(["serve", "--help"])
watched = set(sys.argv[1:])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in watched or m.startswith("radixserve_bench"))))
"""

# the bench extra's libraries made unimportable, as in an install without the extra
WITHOUT_BENCH_EXTRA = """
import importlib.abc, json, sys
refused = set(json.loads(sys.argv[1]))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in refused:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Refuse())
for name in refused:
    sys.modules.pop(name, None)
from radixserve.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _without_extra(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_BENCH_EXTRA, json.dumps(sorted(BENCH_LIBRARIES)), *args],
                          capture_output=True, text=True, timeout=300)


def test_serving_imports_nothing_of_the_benchmark() -> None:
    assert set(NEVER_SERVING) <= set(BENCH_LIBRARIES)
    proc = subprocess.run([sys.executable, "-c", IMPORTED_BY_SERVING, *NEVER_SERVING, *BENCH_LIBRARIES],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_bench_without_the_extra_names_it(tmp_path: Path) -> None:
    for args, command in ((["bench", "--smoke", "--no-progress"], "radixserve bench"),
                          (["bench", "scale-out", "--smoke", "--no-progress"], "radixserve bench scale-out")):
        proc = _without_extra([*args, "--out", str(tmp_path / "out")])
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert f"{command} needs the bench extra: {INSTALL_HINT}" in proc.stderr
        assert "Traceback" not in proc.stderr and "matplotlib" in proc.stderr
        assert not (tmp_path / "out").exists()  # refused before running anything


def test_bench_subcommands_that_need_none_of_it_still_run() -> None:
    proc = _without_extra(["bench", "micro", "--smoke"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "scheduler" in proc.stdout
