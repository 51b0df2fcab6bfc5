"""ModelSpec: the shape of a supported decoder, derived once from a HF config and then read-only.

Owns which architectures we run and how their config quirks map onto one Llama-shaped model:
Qwen2 has q/k/v biases, Qwen3 normalises q and k per head, Mistral (and Qwen with sliding layers)
limit attention to a window. Invariants: num_heads is a multiple of num_kv_heads; the MLP is SwiGLU;
`max_position_embeddings` is the *usable* context: with a sliding window smaller than the config's
context it is capped to the window, because within the window sliding attention equals full causal
attention, so every position we ever compute is exact (beyond it our backends would be wrong).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.model.rope import RopeParams

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int  # usable context length, see the module docstring
    eos_token_ids: tuple[int, ...]
    rope: RopeParams
    bos_token_id: int | None = None
    sliding_window: int | None = None  # the config's window, None when attention is full

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if min(self.hidden_size, self.num_layers, self.head_dim, self.vocab_size, self.max_position_embeddings) < 1:
            raise ValueError("model dimensions must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        """Build from a transformers PretrainedConfig (or anything with the same attributes)."""
        arch = supported_architecture(getattr(config, "architectures", None), getattr(config, "model_type", None))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"only SwiGLU (hidden_act 'silu') MLPs are supported, config has {act!r}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = {
            "Qwen2ForCausalLM": (True, False),  # Qwen2 hard-wires q/k/v biases, none on o_proj
            "MistralForCausalLM": (False, False),
        }.get(arch, (bias, bias))
        window = _sliding_window(config, arch)
        context = int(config.max_position_embeddings)
        eos = _int_list(getattr(config, "eos_token_id", None)) + list(extra_eos_token_ids)
        return cls(
            architecture=arch,
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=min(context, window) if window else context,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            rope=rope_params_from_config(config),
            bos_token_id=getattr(config, "bos_token_id", None),
            sliding_window=window,
        )


# Configs written without `architectures` (e.g. converted from GGUF) still name their model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def supported_architecture(architectures: Any, model_type: Any = None) -> str:
    """The first supported name in a config's `architectures`, else a ValueError naming ours."""
    for name in architectures or ():
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if not architectures and model_type in _ARCHITECTURE_OF_MODEL_TYPE:
        return _ARCHITECTURE_OF_MODEL_TYPE[model_type]
    named = repr(architectures) if architectures else f"model_type {model_type!r}" if model_type else "(none named)"
    raise ValueError(f"unsupported model architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def rope_params_from_config(config: Any) -> RopeParams:
    """RoPE settings from transformers 5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        raw = dict(params)
    else:
        raw = dict(getattr(config, "rope_scaling", None) or {})
        raw.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if float(raw.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return RopeParams(theta=float(raw["rope_theta"]))
    try:
        if rope_type == "linear":
            return RopeParams(theta=float(raw["rope_theta"]), rope_type="linear", factor=float(raw["factor"]))
        if rope_type == "llama3":
            return RopeParams(
                theta=float(raw["rope_theta"]),
                rope_type="llama3",
                factor=float(raw["factor"]),
                low_freq_factor=float(raw["low_freq_factor"]),
                high_freq_factor=float(raw["high_freq_factor"]),
                original_max_position_embeddings=int(
                    raw.get("original_max_position_embeddings") or config.max_position_embeddings
                ),
            )
    except KeyError as missing:
        raise ValueError(f"{rope_type} rope settings lack {missing}") from None
    return RopeParams(rope_type=rope_type)  # raises: names the supported rope types


def load_spec(path: str | Path) -> ModelSpec:
    """Read a HF model directory's config.json (+ generation_config.json) without touching the network."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist or is not a directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(root)!r} has no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {config_file}: {err}") from None
    # Checked on the raw JSON first so an architecture transformers does not know still gets our message.
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    supported_architecture(raw.get("architectures"), raw.get("model_type"))

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    return ModelSpec.from_hf_config(config, tuple(_generation_eos(root)))


def _generation_eos(root: Path) -> list[int]:
    gen_file = root / "generation_config.json"
    if not gen_file.is_file():
        return []
    try:
        return _int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"cannot read {gen_file}: {err}") from None


def _sliding_window(config: Any, arch: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen configs carry a window that only applies to layers marked sliding.
        layer_types = getattr(config, "layer_types", None) or ()
        if "sliding_attention" not in layer_types:
            return None
    return int(window)


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
