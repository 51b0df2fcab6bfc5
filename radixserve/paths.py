"""Where radixserve keeps the files it makes: converted checkpoints, built C++ extensions, shapes.

One root for all of them, chosen by the environment so that tests and CI can point it elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$RADIXSERVE_CACHE, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    explicit = os.environ.get("RADIXSERVE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "radixserve"
