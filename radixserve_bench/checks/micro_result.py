"""What the CPU micro-timing checks (cpu-linear, cpu-attention) write: their rows with the thread
count and the date, as JSON to `path` when one is given."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


def write_result(rows: list[dict[str, Any]], path: Path | None) -> None:
    result = {"threads": torch.get_num_threads(), "rows": rows, "date": time.strftime("%Y-%m-%d")}
    if path:
        path.write_text(json.dumps(result, indent=2) + "\n")
