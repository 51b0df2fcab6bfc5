"""Write a random-weight HF checkpoint of a real model's shapes: for end-to-end GPU benchmarks
against transformers (which needs weights on disk; `radixserve bench step` needs none), and for
serving any model family without downloading it.

    radixserve bench random-checkpoint --shape llama-3.2-1b --out /tmp/rs-1b [--tokenizer DIR]
    radixserve bench random-checkpoint --family gemma3 --out /tmp/rs-gemma3             # tiny
    radixserve bench random-checkpoint --family gpt-oss --size real --max-gb 8 --out /tmp/rs-oss

--shape: transformers builds the model from the shape's config.json (its own initialisation, bf16, on
the GPU when there is one) and saves it as safetensors; the tokenizer files are copied from --tokenizer.

--family: the config is transformers' own config class of the family (`AutoConfig.for_model`) given
the published checkpoint's fields (step_shapes.FAMILY_SHAPES), and the weights are what
`AutoModelForCausalLM.from_config(...).save_pretrained` writes, so tensor names, fused and stacked
layouts are the real checkpoint's (gpt-oss's experts as transformers saves them: stacked bf16, not
the published MXFP4 blocks).

--size tiny (the default): hidden 64, 4 heads of 16, 2 kv heads (1 or 4 where the family's checkpoint
has MQA or MHA), 4 experts (top-2 at most), windows of at most 32 tokens, a context of at most 4096
(the published one where the rope is scaled for it), one of each kind of layer the pattern has (at
least 2 layers), every other setting the real one's (softcaps, scalings, rope settings, biases), fp32:
about a MB that serves on a CPU in seconds. --size real: the published shapes in bf16; layers (then
experts) are cut only as far as --max-gb needs, keeping one of each kind of layer the pattern has,
and the cut is printed.

The tokenizer: --tokenizer DIR copies that one (and its generation_config.json); otherwise a byte-level
BPE of a few hundred tokens is trained on the spot with the family's chat template
(family_templates.py), and config.json and generation_config.json name its end-of-turn tokens as eos.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve_bench.step_shapes import FAMILY_SHAPES, SHAPES, TOKENIZER_FILES, FamilyShape, write_shape_dir

DEFAULT_MAX_GB = 8.0
GB = 1e9
# config fields holding one entry per layer, and a list of layer indices; cut with the layers
_PER_LAYER = ("layer_types", "no_rope_layers")
_LAYER_INDICES = ("mlp_only_layers",)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral and gpt-oss; Qwen3-MoE; Nemotron 3
TINY_WINDOW = 32
TINY_CONTEXT = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=sorted(SHAPES), help="a Llama shape of `radixserve bench step`, bf16")
    which.add_argument("--family", choices=sorted(FAMILY_SHAPES),
                       help="a model family: the shapes of its published checkpoint (see --size)")
    p.add_argument("--size", choices=("tiny", "real"), default="tiny",
                   help="--family: tiny (about a MB of fp32 weights) or real (the published shapes, bf16, within "
                        "--max-gb) (default %(default)s)")
    p.add_argument("--max-gb", type=float, default=DEFAULT_MAX_GB,
                   help="--size real: the most GB (1e9 bytes) of weights; layers, then experts, are cut to fit "
                        "(default %(default)s)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None,
                   help="directory holding tokenizer.json etc. (default for --family: a small BPE trained on "
                        "the spot with the family's chat template)")
    p.add_argument("--seed", type=int, default=0)


def run(a: argparse.Namespace) -> int:
    tokenizer = Path(a.tokenizer) if a.tokenizer else None
    if tokenizer is not None and not tokenizer.is_dir():  # scripts/gpu_check.sh passes one that may be absent
        print(f"--tokenizer {a.tokenizer}: no such directory; going on without it")
        tokenizer = None
    if a.family:
        written = write_family_checkpoint(a.family, a.size, Path(a.out), tokenizer, a.max_gb, a.seed)
        for line in written.report():
            print(line)
        return 0
    from transformers import AutoConfig, AutoModelForCausalLM

    out = write_shape_dir(SHAPES[a.shape], Path(a.out), tokenizer)
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"wrote {a.shape} with random weights to {out}")
    return 0


@dataclass
class FamilyCheckpoint:
    """What `write_family_checkpoint` wrote."""

    family: str
    size: str
    path: Path
    source: str  # the checkpoint whose shapes these are
    weight_bytes: int
    dtype: str
    layers: int
    tokenizer: str  # where the tokenizer came from
    cuts: list[str] = field(default_factory=list)  # what was scaled down, and why

    def report(self) -> list[str]:
        amount = (f"{self.weight_bytes / GB:.2f} GB" if self.weight_bytes >= GB / 10
                  else f"{self.weight_bytes / 1e6:.1f} MB")
        lines = [f"wrote {self.family} ({self.size}, shapes of {self.source}) with random weights to {self.path}: "
                 f"{self.layers} layers, {amount} of {self.dtype} weights"]
        lines += [f"  scaled: {cut}" for cut in self.cuts]
        lines.append(f"  tokenizer: {self.tokenizer}")
        return lines


def write_family_checkpoint(family: str, size: str, out: Path, tokenizer_dir: Path | None = None,
                            max_gb: float = DEFAULT_MAX_GB, seed: int = 0) -> FamilyCheckpoint:
    """A random-weight checkpoint of `family` ("tiny" or "real") with a tokenizer and chat template in `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from radixserve_bench.chat_tokenizer import write_chat_tokenizer
    from radixserve_bench.family_templates import FORMAT_OF_FAMILY

    if family not in FAMILY_SHAPES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(sorted(FAMILY_SHAPES))}")
    if size not in ("tiny", "real"):
        raise ValueError(f"unknown size {size!r}; choose tiny or real")
    shape, fmt = FAMILY_SHAPES[family], FORMAT_OF_FAMILY[family]
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(shape.config)
    # the published vocabulary, where the shape leaves it to the config class's default (Granite 4)
    fields.setdefault("vocab_size", int(AutoConfig.for_model(shape.model_type, **fields).vocab_size))
    if tokenizer_dir is not None:
        tokenizer = _copy_tokenizer(tokenizer_dir, out)
        fields["vocab_size"] = max(int(fields["vocab_size"]), len(tokenizer))
        origin = f"copied from {tokenizer_dir} ({len(tokenizer)} tokens)"
    else:
        tokenizer = write_chat_tokenizer(fmt, out)
        ids = tokenizer.convert_tokens_to_ids
        fields.update(eos_token_id=[ids(t) for t in fmt.stop], pad_token_id=ids(fmt.pad),
                      bos_token_id=ids(fmt.bos) if fmt.bos else None)
        origin = (f"a byte-level BPE of {len(tokenizer)} tokens trained here, with the family's chat template; "
                  f"eos {', '.join(fmt.stop)}")
        if size == "tiny":
            fields["vocab_size"] = len(tokenizer)
        else:
            origin += f" (the embedding keeps the published {fields['vocab_size']} rows)"
    cuts: list[str] = []
    if size == "tiny":
        config = AutoConfig.for_model(shape.model_type, **_tiny_fields(shape, fields))
        dtype = torch.float32
    else:
        config, cuts = fit_to_budget(shape.model_type, fields, int(max_gb * GB))
        dtype = torch.bfloat16
    torch.manual_seed(seed)
    device = "cuda" if size == "real" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    if tokenizer_dir is None or not (tokenizer_dir / "generation_config.json").is_file():
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(out)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return FamilyCheckpoint(family, size, out, shape.source, weight_bytes, str(dtype).removeprefix("torch."),
                            int(config.num_hidden_layers), origin, cuts)


def _copy_tokenizer(src: Path, out: Path) -> Any:
    from transformers import AutoTokenizer

    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def _tiny_fields(shape: FamilyShape, fields: dict[str, Any]) -> dict[str, Any]:
    """The real fields with the sizes shrunk: every switch of the family (softcaps, scalings, biases, rope
    settings, the layer pattern) stays as published."""
    from transformers import AutoConfig

    real = AutoConfig.for_model(shape.model_type, **fields)
    heads, kv = int(real.num_attention_heads), int(getattr(real, "num_key_value_heads", None) or real.num_attention_heads)
    # a shorter context, unless the rope's scaling (yarn's, Llama 3's) is set for the published one
    context = int(real.max_position_embeddings)
    if not _rope_scaled(real):
        context = min(context, TINY_CONTEXT)
    tiny = dict(fields, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                num_key_value_heads=4 if kv == heads else 1 if kv == 1 else 2, max_position_embeddings=context)
    if getattr(real, "moe_intermediate_size", None):
        tiny["moe_intermediate_size"] = 32
    if getattr(real, "moe_shared_expert_intermediate_size", None):  # Nemotron 3's shared expert
        tiny["moe_shared_expert_intermediate_size"] = 48
    if getattr(real, "mamba_n_heads", None):  # Granite 4, Falcon-H1: the heads must divide the inner width
        tiny.update(mamba_n_heads=8, mamba_d_head=16)
        if getattr(real, "mamba_d_ssm", None):  # Falcon-H1 names the inner width
            tiny["mamba_d_ssm"] = 8 * 16
    for name in _EXPERT_COUNTS:
        if getattr(real, name, None):
            tiny[name] = 4
            tiny["num_experts_per_tok"] = min(int(real.num_experts_per_tok), 2)
    if getattr(real, "sliding_window", None):
        tiny["sliding_window"] = min(int(real.sliding_window), TINY_WINDOW)
    layers = max(2, pattern_layers(real))
    if fields.get("global_head_dim"):  # Gemma 4: its global layers' wider heads, and their own kv heads
        tiny["global_head_dim"] = 32
        if fields.get("num_global_key_value_heads"):
            tiny["num_global_key_value_heads"] = 1
    if fields.get("hidden_size_per_layer_input"):  # Gemma 4's per-layer embeddings, of the tiny vocabulary
        tiny.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=tiny["vocab_size"])
    if fields.get("num_kv_shared_layers"):  # twice the pattern: one of each kind projects K/V, one reads it
        layers *= 2
    return _with_layers(tiny, real, layers)


def _rope_scaled(config: Any) -> bool:
    """Whether a rope setting of the config extends a shorter original context."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    return any(p.get("original_max_position_embeddings") for p in nested or [params])


def pattern_layers(config: Any) -> int:
    """The fewest leading layers that hold every kind of layer the config has (one of each value of each
    per-layer field: sliding and full attention, with and without rope)."""
    need = 1
    for name in _PER_LAYER:
        values = list(getattr(config, name, None) or ())
        kinds = set(values)
        for n in range(1, len(values) + 1):
            if set(values[:n]) == kinds:
                need = max(need, n)
                break
    return need


def _with_layers(fields: dict[str, Any], full: Any, layers: int) -> dict[str, Any]:
    """`fields` for a model of the first `layers` layers of `full` (its per-layer fields cut to them)."""
    out = dict(fields, num_hidden_layers=layers)
    for name in _PER_LAYER:
        values = getattr(full, name, None)
        if values and not _derived(full, name):
            out[name] = list(values)[:layers]
    for name in _LAYER_INDICES:
        values = getattr(full, name, None)
        if values:
            out[name] = [i for i in values if i < layers]
    shared = int(getattr(full, "num_kv_shared_layers", 0) or 0)
    if shared:  # Gemma 4: the same share of the layers read earlier ones' K/V, after one of each kind that projects it
        total = int(full.num_hidden_layers)
        out["num_kv_shared_layers"] = max(0, min(shared * layers // total, layers - pattern_layers(full)))
    return out


def _derived(config: Any, name: str) -> bool:
    """Whether the config computes `name` itself (Falcon-H1's layer types: a read-only property)."""
    attribute = getattr(config, "attribute_map", {}).get(name, name)
    described = getattr(type(config), attribute, None)
    return isinstance(described, property) and described.fset is None


def weight_bytes(config: Any, bytes_per_weight: int = 2) -> int:
    """The bytes of a model's weights (tied ones once), counted on the meta device: nothing is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * bytes_per_weight


def fit_to_budget(model_type: str, fields: dict[str, Any], budget: int) -> tuple[Any, list[str]]:
    """The family's config with as many of its layers (then experts) as fit `budget` bytes of bf16 weights,
    and a line for each cut. ValueError when even one of each kind of layer with the fewest experts does
    not fit."""
    from transformers import AutoConfig

    full = AutoConfig.for_model(model_type, **fields)
    total = int(full.num_hidden_layers)
    fewest = min(pattern_layers(full), total)

    def build(layers: int, extra: dict[str, Any] | None = None) -> Any:
        return AutoConfig.for_model(model_type, **_with_layers({**fields, **(extra or {})}, full, layers))

    if weight_bytes(full) <= budget:
        return full, []
    cuts: list[str] = []
    layers = _largest(fewest, total, lambda n: weight_bytes(build(n)) <= budget)
    if layers is not None:
        cuts.append(f"layers {total} -> {layers} to fit --max-gb {budget / GB:g} "
                    f"(all {total}: {weight_bytes(full) / GB:.2f} GB)")
        return build(layers), cuts
    # the checkpoint's own name for it (a config class may alias the other)
    expert_field = next((name for name in _EXPERT_COUNTS if fields.get(name)), None)
    if expert_field is None:
        raise ValueError(f"{model_type}: even {fewest} layer(s) take {weight_bytes(build(fewest)) / GB:.2f} GB, "
                         f"over --max-gb {budget / GB:g}")
    experts, top_k = int(getattr(full, expert_field)), int(full.num_experts_per_tok)
    kept = _largest(top_k, experts, lambda e: weight_bytes(build(fewest, {expert_field: e})) <= budget)
    if kept is None:
        smallest = weight_bytes(build(fewest, {expert_field: top_k}))
        raise ValueError(f"{model_type}: even {fewest} layer(s) with {top_k} experts take {smallest / GB:.2f} GB, "
                         f"over --max-gb {budget / GB:g}")
    cuts.append(f"layers {total} -> {fewest} (one of each kind the layer pattern has) and {expert_field} "
                f"{experts} -> {kept} (top-{top_k} routing kept) to fit --max-gb {budget / GB:g} "
                f"(all: {weight_bytes(full) / GB:.2f} GB)")
    return build(fewest, {expert_field: kept}), cuts


def _largest(low: int, high: int, fits: Any) -> int | None:
    """The largest n in [low, high] with fits(n), for a `fits` true up to some n and false above; None if none."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
