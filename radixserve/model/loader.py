"""Load a local HF model directory: config.json + *.safetensors (single or sharded) and the tokenizer.

Never touches the network. Invariants: every parameter of the built model is filled from the
checkpoint exactly once or loading fails naming what is missing; checkpoint tensors we do not know
fail loudly too (a silently ignored tensor usually means a wrong architecture mapping), except the
few that are derivable (rotary inv_freq) or redundant (lm_head of a tied model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.spec import ModelSpec, load_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_LAYER_PREFIX = "model.layers."


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto"
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """Build the model of `path`'s config.json. load_format "auto" fills it from the checkpoint;
    "dummy" fills it with seeded random weights of the same shapes (speed tests need no checkpoint)."""
    root = Path(path)
    spec = load_spec(root)  # raises for a missing directory, config.json or an unsupported architecture
    if load_format == "dummy":
        model = LlamaForCausalLM(spec, dtype, device)
        fill_dummy_weights(model)
    elif load_format == "auto":
        files = weight_files(root)
        model = LlamaForCausalLM(spec, dtype, device)
        _load_weights(model, files)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    model.eval()
    return model, spec


@torch.no_grad()
def fill_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Seeded random weights: norms at 1, everything else N(0, 0.02) as an initialised model has
    (small enough that activations stay finite through any depth)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
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


@torch.no_grad()
def _load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    packed = model.packed_shards()
    expected = _expected_names(params, packed)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                target = _target(name, packed)
                if target is None or target[0] not in params:
                    if not _ignorable(name, model.spec):
                        unexpected.append(name)
                    continue
                param_name, first_row, rows = target
                dest: torch.Tensor = params[param_name]
                if rows is not None:
                    dest = dest.narrow(0, first_row, rows)
                tensor = shard.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {_few(unexpected)}")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors: {_few(missing)}")


def _target(name: str, packed: dict[str, tuple[str, int, int]]) -> tuple[str, int, int | None] | None:
    """Our parameter for HF tensor `name`, with the row range it fills when packed."""
    if not name.startswith(_LAYER_PREFIX):
        return name, 0, None
    index, _, rest = name[len(_LAYER_PREFIX) :].partition(".")
    module, _, leaf = rest.rpartition(".")
    if module in packed:
        ours, first_row, rows = packed[module]
        return f"{_LAYER_PREFIX}{index}.{ours}.{leaf}", first_row, rows
    return name, 0, None


def _expected_names(params: dict[str, Any], packed: dict[str, tuple[str, int, int]]) -> set[str]:
    names = set()
    for name in params:
        hf_names = [
            name.replace(f".{ours}.", f".{hf}.") for hf, (ours, _, _) in packed.items() if f".{ours}." in name
        ]
        names.update(hf_names or [name])
    return names


def _ignorable(name: str, spec: ModelSpec) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and spec.tie_word_embeddings)


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_tokenizer(path: str | Path) -> Any | None:
    """The directory's HF tokenizer (a transformers TokenizersBackend), or None when it has none."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist or is not a directory")
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)
