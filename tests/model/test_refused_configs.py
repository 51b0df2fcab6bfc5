"""A checkpoint whose architecture or config value we do not implement is refused at start, before
any weight is read, with one line naming the field and what is supported; `radixserve serve` exits
non-zero with that line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_model_dir

from radixserve.model.spec import load_spec


def _edited(tmp_path: Path, arch: str, **changes: object) -> Path:
    config = json.loads((tiny_model_dir(arch) / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_model_dir(arch) / "model.safetensors")
    return tmp_path


REFUSED = [
    ("gemma3", {"layer_types": ["sliding_attention", "linear_attention", "full_attention"]},
     "layer_types 'linear_attention' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "unsupported rope_type 'dynamic'"),
    ("llama", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported; supported:"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention True is not supported"),
    ("olmo3", {"sliding_window": None}, "sliding_window is not set"),
    ("llama", {"architectures": ["LlavaForConditionalGeneration"]}, "unsupported model architecture"),
    ("gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all' is not supported"),
    ("nemotron_h", {"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported; supported: relu2"),
    ("nemotron_h", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' is not supported; supported: silu"),
    ("nemotron_h_moe", {"mlp_bias": True}, "mlp_bias in a Nemotron-H MoE layer is not supported"),
    ("nemotron_h_moe", {"n_group": 3}, "3 expert groups need sigmoid_topk routing and num_experts 8 split into groups"),
    ("nemotron_h_moe", {"topk_group": 3}, "topk_group 3 must be in"),
]


@pytest.mark.parametrize("arch, changes, message", REFUSED, ids=[m.split(" ")[0] for _, _, m in REFUSED])
def test_unsupported_config_values_are_named(tmp_path: Path, arch: str, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")) as err:
        load_spec(_edited(tmp_path, arch, **changes))
    assert "\n" not in str(err.value)


def test_serve_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    model = _edited(tmp_path, "gemma3", layer_types=["sliding_attention", "linear_attention", "full_attention"])
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model", str(model), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "layer_types 'linear_attention' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr
