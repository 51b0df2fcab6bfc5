"""Load a local HF model directory: config.json + *.safetensors (single or sharded) and the tokenizer;
a GGUF file path goes to `gguf_checkpoint` instead.

Never touches the network. Invariants: every parameter of the built model is filled from the
checkpoint exactly once or loading fails naming what is missing; checkpoint tensors we do not know
fail loudly too (a silently ignored tensor usually means a wrong architecture mapping), except the
few that are derivable (rotary inv_freq) or redundant (lm_head of a tied model).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.model.decoder import CausalLM
from radixserve.model.gguf_checkpoint import is_gguf_path, load_gguf_model, load_gguf_tokenizer
from radixserve.model.spec import CheckpointLayout, MlpSpec, ModelSpec, load_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_LAYER_PREFIX = "model.layers."


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
    keep_quantized: bool = False, quantized_activations: str = "int8", sliding_window_kv: str = "all",
) -> tuple[CausalLM, ModelSpec]:
    """Build the model of `path`'s config.json. load_format "auto" fills it from the checkpoint;
    "dummy" fills it with seeded random weights of the same shapes (speed tests need no checkpoint).
    A GGUF file keeps its quantized tensors with `keep_quantized` where the CPU kernels run them,
    taking `quantized_activations` inputs (`gguf_checkpoint.load_gguf_model`), else is dequantized
    into `dtype`. `sliding_window_kv` (all, window or window-blocks): where sliding-window layers keep
    their K/V (`ModelSpec.with_sliding_window_kv`)."""
    if is_gguf_path(path):
        return load_gguf_model(path, dtype, device, keep_quantized, load_format, quantized_activations,
                               sliding_window_kv)
    root = Path(path)
    # raises for a missing directory, config.json or an unsupported architecture
    spec = load_spec(root).with_sliding_window_kv(sliding_window_kv)
    if load_format == "dummy":
        model = CausalLM(spec, dtype, device)
        fill_dummy_weights(model)
    elif load_format == "auto":
        from radixserve.model.quantized_checkpoint import load_quantized_weights, read_quantization

        scheme = read_quantization(root)  # None: full precision; refuses an unsupported scheme before any weight
        files = weight_files(root)
        model = CausalLM(spec, dtype, device)
        if scheme is None:
            _load_weights(model, files)
        else:
            load_quantized_weights(model, files, scheme)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    model.eval()
    return model, spec


@torch.no_grad()
def fill_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Seeded random weights: norms at 1, everything else N(0, 0.02) as an initialised model has
    (small enough that activations stay finite through any depth)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):  # a DeltaNet's gated norm stores w itself
            param.fill_(1.0)
        elif name.endswith("norm.weight"):
            param.fill_(0.0 if model.spec.norm_style == "gemma" else 1.0)  # gemma stores w - 1
        else:
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
                        .mul_(0.02).to(param.dtype))


def weight_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the shard index names, else every *.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"cannot read shard index {index}: {err}") from None
        files = [root / n for n in names]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{root} lacks shards named in {index.name}: {', '.join(absent)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        other = [p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(other)}; only safetensors are supported)" if other else ""
        raise FileNotFoundError(f"no *.safetensors weights in {root}{hint}")
    return files


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param`'s expert `expert` (stacked MoE weights), rows
    [first_row, first_row + rows) when packed, after `convert` (a layout change, e.g. gpt-oss's
    interleaved, transposed experts)."""

    param: str
    first_row: int = 0
    rows: int | None = None
    expert: int | None = None
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None


def checkpoint_targets(model: CausalLM) -> dict[str, Target]:
    """Every tensor the checkpoint must hold, by its name there, and where it goes: the strict
    loader's whole contract (each used exactly once, none missing, none left over)."""
    spec, layout = model.spec, model.spec.checkpoint
    norm_names = dict(layout.norm_names)
    targets: dict[str, Target] = {}
    for name, _ in model.named_parameters():
        if not name.startswith(_LAYER_PREFIX):
            targets[name] = Target(name)
            continue
        index, _, rest = name[len(_LAYER_PREFIX):].partition(".")
        layer = f"{_LAYER_PREFIX}{index}."
        module, _, leaf = rest.rpartition(".")
        mlp = spec.layers[int(index)].mlp or MlpSpec(0)  # a mixer-only layer has no mlp.* parameters
        if module == "self_attn.qkv_proj" and not layout.fused_qkv:
            attention = spec.layers[int(index)].attention
            assert attention is not None
            q = spec.num_heads * spec.head_dim_of(attention) * (2 if attention.output_gate else 1)
            kv = spec.kv_size_of(attention)
            pieces = [("q_proj", 0, q)]
            if attention.kv_source is None:  # a layer reading another's K/V projects none
                pieces.append(("k_proj", q, kv))
                if not attention.value_from_key:  # one whose values are its keys has no v_proj
                    pieces.append(("v_proj", q + kv, kv))
            for hf, first, rows in pieces:
                targets[f"{layer}self_attn.{hf}.{leaf}"] = Target(name, first, rows)
        elif rest.startswith("experts."):  # experts beside the MLP (Gemma 4): its router and stacked experts
            targets[f"{layer}{_BESIDE_NAMES[rest.removeprefix('experts.')]}"] = Target(name)
        elif module in ("mlp.gate_up_proj", "mlp.shared_expert.gate_up_proj") and not layout.fused_gate_up:
            inter = mlp.intermediate_size if module == "mlp.gate_up_proj" else mlp.shared_intermediate_size
            base = module.removesuffix("gate_up_proj")
            targets[f"{layer}{base}gate_proj.{leaf}"] = Target(name, 0, inter)
            targets[f"{layer}{base}up_proj.{leaf}"] = Target(name, inter, inter)
        elif rest.startswith("mlp.shared_expert"):  # its down projection and its gate: as named
            targets[name] = Target(name)
        elif rest.startswith("mlp.") and mlp.is_moe:
            targets.update(_expert_targets(name, layer, rest, mlp, layout))
        elif module in norm_names:
            targets[f"{layer}{norm_names[module]}.{leaf}"] = Target(name)
        else:
            targets[name] = Target(name)
    if layout.renames:
        targets = {_renamed(name, layout.renames): target for name, target in targets.items()}
    return targets


# Gemma 4's names for the parts of the experts beside its MLP: ours are `MoE`'s
_BESIDE_NAMES = {"router.weight": "router.proj.weight", "router_scale": "router.scale",
                 "per_expert_scale": "router.per_expert_scale", "gate_up": "experts.gate_up_proj",
                 "down": "experts.down_proj"}


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`name` with each of our module paths in `renames` replaced by the checkpoint's (whole path
    components only)."""
    dotted = f".{name}."
    for ours, theirs in renames:
        dotted = dotted.replace(f".{ours}.", f".{theirs}.")
    return dotted[1:-1]


def _expert_targets(name: str, layer: str, rest: str, mlp: MlpSpec, layout: CheckpointLayout) -> dict[str, Target]:
    prefix = f"{layer}{layout.mlp_name}."
    if rest.startswith("mlp.router."):
        return {f"{prefix}{layout.router_name}.{rest.rpartition('.')[2]}": Target(name)}
    if rest == "mlp.expert_bias":
        return {f"{prefix}{layout.expert_bias_name}": Target(name)}
    piece = rest.removeprefix("mlp.")
    if piece.startswith(("fc1_latent_proj.", "fc2_latent_proj.")):
        return {f"{prefix}{piece}": Target(name)}
    if layout.experts == "input_output_linear":  # Granite: [E, 2I, H] gate then up rows, [E, H, I], as ours
        return {f"{prefix}{'input_linear' if piece == 'gate_up' else 'output_linear'}.weight": Target(name)}
    if layout.experts == "stacked_interleaved":  # gpt-oss: [E, in, out] with gate and up columns interleaved
        stacked = {"gate_up": ("gate_up_proj", _deinterleave_transposed), "gate_up_bias": ("gate_up_proj_bias",
                   _deinterleave), "down": ("down_proj", _transposed), "down_bias": ("down_proj_bias", None)}
        hf, convert = stacked[piece]
        return {f"{prefix}experts.{hf}": Target(name, convert=convert)}
    gate, up, down = ("w1", "w3", "w2") if layout.experts == "w1w3w2" else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, Target] = {}
    inter = mlp.intermediate_size
    for e in range(mlp.num_experts):
        if piece == "gate_up" and not mlp.gated:
            out[f"{prefix}experts.{e}.{up}.weight"] = Target(name, expert=e)
        elif piece == "gate_up":
            out[f"{prefix}experts.{e}.{gate}.weight"] = Target(name, 0, inter, expert=e)
            out[f"{prefix}experts.{e}.{up}.weight"] = Target(name, inter, inter, expert=e)
        elif piece == "down":
            out[f"{prefix}experts.{e}.{down}.weight"] = Target(name, expert=e)
        elif piece == "gate_up_bias" and mlp.gated:  # per-expert biases (a GGUF's gpt-oss experts, split)
            out[f"{prefix}experts.{e}.{gate}.bias"] = Target(name, 0, inter, expert=e)
            out[f"{prefix}experts.{e}.{up}.bias"] = Target(name, inter, inter, expert=e)
        elif piece == "down_bias":
            out[f"{prefix}experts.{e}.{down}.bias"] = Target(name, expert=e)
        else:
            raise ValueError(f"{layout.experts} experts have no {piece}")
    return out


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate, up alternating -> [..., 2I] gate columns then up columns."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def _deinterleave_transposed(t: torch.Tensor) -> torch.Tensor:
    return _deinterleave(t).transpose(-1, -2)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


@torch.no_grad()
def _load_weights(model: CausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                target = targets.get(name)
                if target is None:
                    if not _ignorable(name, model.spec):
                        unexpected.append(name)
                    continue
                dest: torch.Tensor = params[target.param]
                if target.expert is not None:
                    dest = dest[target.expert]
                if target.rows is not None:
                    dest = dest.narrow(0, target.first_row, target.rows)
                tensor = shard.get_tensor(name)
                if target.convert is not None:
                    tensor = target.convert(tensor)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {_few(sorted(unexpected))}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors: {_few(missing)}")


def _ignorable(name: str, spec: ModelSpec) -> bool:
    # mtp.*: multi-token-prediction heads (Nemotron 3, Qwen3.5), which transformers skips too; our
    # drafts come from the cache
    # the other modalities' towers of a multimodal checkpoint whose text model we serve (`skipped_prefixes`)
    return (name.endswith("rotary_emb.inv_freq") or name.startswith(("mtp.", *spec.checkpoint.skipped_prefixes))
            or (name == "lm_head.weight" and spec.tie_word_embeddings))


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_tokenizer(path: str | Path) -> Any | None:
    """The directory's HF tokenizer (a transformers TokenizersBackend), or None when it has none; a
    GGUF file's is converted from its metadata (once, then cached)."""
    if is_gguf_path(path):
        return load_gguf_tokenizer(path)
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist or is not a directory")
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)
