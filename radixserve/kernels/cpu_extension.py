"""radixserve's C++ extension for the CPU: building it once and loading it.

The extension (`csrc/`) holds what the CPU path runs: the matmul kernel every projection and the
LM head use (`radixserve::linear`, `csrc/linear.cpp`; `cpu_linear.BlockedLinear`, and on a GGUF
file's quantized blocks `ggml_quants.QuantizedLinear`, decoded by `csrc/ggml_formats.h`), the paged
attention of short rows (`radixserve::paged_attention`, windows, sinks and softcaps included), the
decoder layer's residual add + RMSNorm and SiLU-and-mul (`radixserve::add_rms_norm`,
`radixserve::silu_and_mul`, `csrc/elementwise.cpp`; `model/ops.CpuKernelOps`), the routed experts of a
mixture-of-experts layer (`radixserve::moe_experts`, `csrc/moe.cpp`; `kernels/moe.py`), the gated delta
rule of Gated DeltaNet layers (`radixserve::gated_delta_rule`, `csrc/delta_rule.cpp`;
`model/delta_net.py`), the selective scan of Mamba2 layers (`radixserve::mamba2_scan`,
`csrc/mamba2_scan.cpp`; `model/mamba2.py`), and the compiled step that runs every decoder layer of a
short-row step in one call (`radixserve::short_step`, `csrc/cpu_step.cpp`; `cpu_step.CpuStep`).

It is built with the system's C++ compiler for this machine's CPU (`-march=native`: the kernels'
16 lanes become one AVX-512 vector, two AVX2 ones or four NEON or SSE ones), once per source text,
torch installation and CPU, into the user cache beside the converted model (`make setup` builds it ahead; a later start
loads it in well under a second). A machine that cannot build it runs oneDNN's matmuls and the
Python layers, and the log says why.

Invariant: the build directory's name is a digest of everything the binary depends on (the sources,
torch's place and version, the CPU), so a directory never holds a build another environment or CPU
made; a builder holds a lock that dies with its process.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.paths import cache_root

log = logging.getLogger(__name__)

SOURCE_DIRECTORY = Path(__file__).with_name("csrc")
# the .cpp files are compiled; the header, which they include, is part of the source text all the same
SOURCES = ("cpu_kernels.h", "ggml_formats.h", "cpu_step.cpp", "delta_rule.cpp", "elementwise.cpp", "linear.cpp",
           "mamba2_scan.cpp", "moe.cpp", "paged_attention.cpp")
EXTENSION = "radixserve_cpu"
# -march: this CPU's vectors (RADIXSERVE_CPU_MARCH names another target, e.g. haswell or x86-64 to
# test the AVX2 or SSE path on a wider machine); -ffp-contract=off: cpu_step.cpp's
# elementwise loops round as ATen's kernels do (the kernels fuse their multiply-adds explicitly);
# -fopenmp: at::parallel_for runs on torch's threads (the process's one OpenMP runtime, torch's own
# libgomp, which the loader shares by its soname)
MARCH = os.environ.get("RADIXSERVE_CPU_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-ffp-contract=off", "-fopenmp"]


@dataclass(frozen=True)
class Extension:
    """The loaded extension: how long making it ready took, whether that included building it, and
    where it lives."""

    seconds: float
    built: bool
    directory: Path


def _cpu_identity() -> bytes:
    """What `-march=native` compiles for: the machine's architecture and its CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    described = sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted})
    return "\n".join([platform.machine(), platform.processor(), *described]).encode()


def build_directory(source_directory: Path = SOURCE_DIRECTORY) -> Path:
    """One directory per source text, torch installation (version and place: the build names its
    headers' paths) and CPU."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((source_directory / name).read_bytes())
    digest.update(str(Path(torch.__file__).parent).encode() + " ".join(FLAGS).encode() + _cpu_identity())
    return cache_root() / "cpu_extension" / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


@functools.cache
def load_extension(source_directory: Path = SOURCE_DIRECTORY) -> Extension:
    """Build (or reuse) and load the extension; raises when this machine cannot build it. Once per
    process: its operator namespace can be registered only once."""
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools, only needed on CPU

    started = time.perf_counter()
    directory = build_directory(source_directory)
    directory.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    with open(directory / "build.flock", "w") as held:
        # torch's own lock is a file that outlives a killed builder and then blocks every later
        # start; this one dies with its holder, and whoever holds it is the only one building, so
        # a torch lock file found under it is stale
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        # built from copies inside the directory: its build file names the sources' paths, so
        # building from the checkout would rebuild whenever another checkout shares the directory
        for name in SOURCES:
            source, copy = source_directory / name, directory / name
            if not copy.exists() or copy.read_bytes() != source.read_bytes():
                shutil.copyfile(source, copy)
        library = directory / f"{EXTENSION}.so"
        before = library.stat().st_mtime_ns if library.exists() else None
        compiled = [str(directory / name) for name in SOURCES if name.endswith(".cpp")]
        cpp_extension.load(name=EXTENSION, sources=compiled, build_directory=str(directory), extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return Extension(time.perf_counter() - started, library.stat().st_mtime_ns != before, directory)


@functools.cache
def loaded_or_explained() -> Extension | None:
    """The extension, loaded now (the log says whether it was built and how long that took), or None
    with the reason logged where this machine cannot build it. Once per process: every caller after
    the first gets the same answer without a second log line."""
    try:
        extension = load_extension()
    except Exception as error:  # no compiler, no headers, a failed build: oneDNN and the Python layers run
        log.warning("CPU kernels: the C++ extension could not be built (%s); matmuls run in oneDNN and every "
                    "step through the Python layers", str(error).strip()[:500])
        return None
    log.info("CPU kernels: C++ extension %s in %.1f s (%s)", "built" if extension.built else "loaded",
             extension.seconds, extension.directory)
    return extension


def _put_ninja_on_path() -> None:
    # torch builds with the `ninja` executable from PATH; the pip package's copy sits in the virtual
    # environment's bin, which is not on PATH when `.venv/bin/radixserve` runs without activation
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
