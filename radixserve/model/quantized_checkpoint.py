"""Quantized checkpoints: read the `quantization_config` of config.json, refuse what we do not run, and
load each layout's tensors into our model.

Supported (`read_quantization`), everything else refused at start with one line naming it:
- FP8 e4m3 weights: quant_method "fp8" (per-tensor or per-channel `weight_scale`, or `weight_scale_inv`
  blocks of `weight_block_size`), "fbgemm_fp8" (per-channel) and compressed-tensors' float-quantized /
  naive-quantized 8-bit float weights (tensor, channel or block strategy). A static `input_scale` is
  read and dropped: activations stay in the model dtype (weight-only, W8A16).
- 4-bit integer weights with per-group zeros and scales: AutoAWQ's GEMM layout ("awq": `qweight`
  [K, N/8] packed along N in AWQ's nibble order, `qzeros`, `scales`), GPTQ ("gptq", v1 zeros stored
  minus one, or gptq_v2; `qweight` [K/8, N], `qzeros`, `scales`, a trivial `g_idx`; act-order refused)
  and compressed-tensors' pack-quantized (`weight_packed` [N, K/8] of signed values + 8,
  `weight_scale`, optional packed `weight_zero_point`, `weight_shape`).
- MXFP4 experts (gpt-oss, "mxfp4"): `*_blocks` (two e2m1 values a byte, low nibble first) and `*_scales`
  (e8m0, one per 32 values), `kernels.mxfp4_format`.

Which modules are quantized is read off the tensors (a layer stored plain loads plain, whatever the
config's ignore lists say). Each quantized linear weight is repacked into one of the two layouts the
kernels read (`kernels.quant_formats`). With kernels (CUDA, or tests under
TRITON_INTERPRET=1) every nn.Linear whose pieces are all quantized becomes a `QuantLinear` running
the Triton dequantize-GEMM (`kernels.quant_gemm`, imported only then: a CPU-only install has no
Triton), and a MoE layer with MXFP4 experts keeps them as `Mxfp4Experts` for the fused MXFP4 MoE
kernels (`kernels.fused_moe_mxfp4`); otherwise (CPU, stacked FP8/int4 MoE experts, a projection mixing
plain and quantized pieces) the weight is dequantized at load into the plain parameter, in the model
dtype, and one log line says how many. The loader's contract holds: every checkpoint tensor is used
exactly once, every parameter filled, or loading fails naming the tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from radixserve.kernels.mxfp4_format import Mxfp4Experts, check_mxfp4, dequantize_mxfp4
from radixserve.kernels.quant_formats import (
    MIN_BLOCK_K,
    Fp8Weight,
    Int4Weight,
    QuantWeight,
    concat_rows,
    dequantize,
    pack_int4_along_k,
)

log = logging.getLogger(__name__)

SUPPORTED_METHODS = ("fp8", "fbgemm_fp8", "awq", "gptq", "compressed-tensors", "mxfp4")
KV_SCALES = (".k_scale", ".v_scale")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization_config says, reduced to what loading needs."""

    method: str  # one of SUPPORTED_METHODS
    fp8_block: tuple[int, int] | None = None  # (rows, columns) of a block scale
    group_size: int | None = None  # int4: k per group (None: read off the tensors; -1 in configs: per channel)
    gptq_zero_offset: int = 0  # GPTQ v1 stores zero - 1
    int4: bool = False  # compressed-tensors: some group is pack-quantized int4
    fp8: bool = False  # compressed-tensors: some group is 8-bit float
    kv_scales: bool = False  # compressed-tensors kv_cache_scheme: attention's k_scale / v_scale, read and dropped

    @property
    def description(self) -> str:
        if self.method == "compressed-tensors":
            kinds = [k for k, on in (("fp8", self.fp8), ("int4 pack-quantized", self.int4)) if on]
            return f"compressed-tensors {' + '.join(kinds)}"
        return self.method


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config {what} is not supported; supported quant_method: {', '.join(SUPPORTED_METHODS)}"
                      " (fp8 e4m3, 4-bit AWQ GEMM / GPTQ / compressed-tensors pack-quantized, MXFP4 experts)")


def read_quantization(root: Path) -> QuantScheme | None:
    """The quantization scheme of the model directory `root`'s config.json, None when it has none;
    a ValueError of one line naming the field when we do not run it."""
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {root / 'config.json'}: {err}") from None
    config = raw.get("quantization_config") if isinstance(raw, dict) else None
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(config).__name__}")
    method = config.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        return _fp8_scheme(method, config)
    if method == "awq":
        return _awq_scheme(config)
    if method == "gptq":
        return _gptq_scheme(config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method == "mxfp4":
        return QuantScheme("mxfp4")
    raise _refuse(f"quant_method {method!r}")


def _fp8_scheme(method: str, config: dict[str, Any]) -> QuantScheme:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt {fmt!r} (only e4m3)")
    block = config.get("weight_block_size")
    return QuantScheme(method, fp8_block=None if block is None else _block(block, "fp8 weight_block_size"))


def _block(value: Any, field: str) -> tuple[int, int]:
    if (not isinstance(value, list | tuple) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value)
            or value[1] % MIN_BLOCK_K):
        raise _refuse(f"{field} {value!r} (two positive ints, the second a multiple of {MIN_BLOCK_K})")
    return int(value[0]), int(value[1])


def _int4_group(value: Any, method: str) -> int | None:
    if value in (-1, None):
        return None
    if not isinstance(value, int) or value <= 0 or value % MIN_BLOCK_K:
        raise _refuse(f"{method} group_size {value!r} (-1 or a positive multiple of {MIN_BLOCK_K})")
    return value


def _awq_scheme(config: dict[str, Any]) -> QuantScheme:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _refuse(f"awq bits {bits!r} (only 4)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (only gemm)")
    if not config.get("zero_point", True):
        raise _refuse("awq zero_point false (only zero_point true)")
    return QuantScheme("awq", group_size=_int4_group(config.get("group_size", config.get("q_group_size")), "awq"))


def _gptq_scheme(config: dict[str, Any]) -> QuantScheme:
    if config.get("bits") != 4:
        raise _refuse(f"gptq bits {config.get('bits')!r} (only 4)")
    if config.get("desc_act"):
        raise _refuse("gptq desc_act true (act-order: reorder the checkpoint without it)")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} (gptq or gptq_v2)")
    return QuantScheme("gptq", group_size=_int4_group(config.get("group_size"), "gptq"),
                       gptq_zero_offset=1 if fmt == "gptq" else 0)


def _compressed_tensors_scheme(config: dict[str, Any]) -> QuantScheme:
    sparsity = config.get("sparsity_config")
    if sparsity and (sparsity.get("format") or "dense") != "dense":
        raise _refuse(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    fp8 = int4 = False
    fp8_block: tuple[int, int] | None = None
    group_sizes: set[int | None] = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or config.get("format")
        kind = (weights.get("type"), weights.get("num_bits"), fmt)
        strategy = weights.get("strategy")
        if kind[:2] == ("float", 8) and fmt in ("float-quantized", "naive-quantized"):
            if strategy not in ("tensor", "channel", "block"):
                raise _refuse(f"compressed-tensors {name} fp8 strategy {strategy!r} (tensor, channel or block)")
            if strategy == "block":
                fp8_block = _block(weights.get("block_structure"), f"compressed-tensors {name} block_structure")
            fp8 = True
        elif kind[:2] == ("int", 4) and fmt == "pack-quantized":
            if strategy not in ("group", "channel"):
                raise _refuse(f"compressed-tensors {name} int4 strategy {strategy!r} (group or channel)")
            if weights.get("actorder") == "group":
                raise _refuse(f"compressed-tensors {name} actorder 'group' (a permuted g_idx)")
            group_sizes.add(_int4_group(weights.get("group_size"), "compressed-tensors") if strategy == "group" else None)
            int4 = True
        else:
            raise _refuse(f"compressed-tensors {name} weights type {kind[0]!r} num_bits {kind[1]!r} format {fmt!r}")
        acts = group.get("input_activations")
        if acts and (acts.get("type"), acts.get("num_bits")) != ("float", 8):
            raise _refuse(f"compressed-tensors {name} input_activations {acts.get('type')!r} {acts.get('num_bits')!r}-bit "
                          "(weights-only or fp8 activations, which run unquantized)")
    return QuantScheme("compressed-tensors", fp8_block=fp8_block, fp8=fp8, int4=int4,
                       group_size=next(iter(group_sizes)) if len(group_sizes) == 1 else None,
                       kv_scales=bool(config.get("kv_cache_scheme")))


# ---------------------------------------------------------------- checkpoint tensors


class _Tensors:
    """Every tensor of the checkpoint's files by name, read on demand; remembers which were used."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self.where: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        self.used: set[str] = set()
        for file in files:
            shard = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in shard.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                self.where[name] = shard
                self.file_of[name] = file.name

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def dtype(self, name: str) -> str:
        return str(self.where[name].get_slice(name).get_dtype())

    def take(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"quantized checkpoint lacks {name}")
        self.used.add(name)
        return self.where[name].get_tensor(name)

    def unused(self) -> Iterator[str]:
        return (n for n in self.where if n not in self.used)


def _read_fp8(name: str, tensors: _Tensors, scheme: QuantScheme) -> Fp8Weight | None:
    if name not in tensors or tensors.dtype(name) not in ("F8_E4M3", "F8_E5M2"):
        return None
    if tensors.dtype(name) == "F8_E5M2":
        raise ValueError(f"{name} is float8_e5m2; only e4m3 weights are supported")
    weight = tensors.take(name)
    if weight.dim() != 2:
        raise ValueError(f"{name} is an FP8 tensor of shape {tuple(weight.shape)}; only 2-D linear weights are supported")
    prefix = name.removesuffix("weight")
    if f"{prefix}input_scale" in tensors:
        tensors.take(f"{prefix}input_scale")  # static activation scale: activations stay in the model dtype
    scale_name = next((f"{name}{s}" for s in ("_scale_inv", "_scale") if f"{name}{s}" in tensors), None)
    if scale_name is None:
        raise ValueError(f"FP8 weight {name} has no {name}_scale or {name}_scale_inv")
    scale = tensors.take(scale_name).float()
    n, k = weight.shape
    bits = weight.view(torch.uint8)
    if scheme.fp8_block is not None:
        bn, bk = scheme.fp8_block
        grid = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) == grid:
            return Fp8Weight(bits, scale.repeat_interleave(bn, dim=0)[:n].contiguous(), bk if grid[1] > 1 else k)
    if scale.numel() == 1:
        return Fp8Weight(bits, scale.reshape(1, 1).expand(n, 1).contiguous(), k)
    if tuple(scale.shape) in ((n, 1), (n,)):
        return Fp8Weight(bits, scale.reshape(n, 1).contiguous(), k)
    raise ValueError(f"{scale_name} has shape {tuple(scale.shape)}: neither per-tensor, per-channel [{n}, 1] nor "
                     f"blocks of {scheme.fp8_block} for a [{n}, {k}] weight")


def _unpack_along_n(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] int32 with 8 columns an int32 (column order[i] of each 8 in nibble i) -> [R, 8C] int64."""
    shifts = torch.tensor([4 * order.index(c) for c in range(8)], dtype=torch.int32)
    return ((packed[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1).long()


def _groups(k: int, groups: int, configured: int | None, name: str) -> int:
    """The group size of a [K, N] weight with `groups` rows of scales."""
    group = k if groups == 1 else configured if configured is not None else k // groups
    if -(-k // group) != groups:
        raise ValueError(f"{name}: {groups} scale groups do not fit K={k} in groups of {group}")
    return group


def _int4(values_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, name: str) -> Int4Weight:
    if group % MIN_BLOCK_K and scales.shape[0] > 1:
        raise ValueError(f"{name}: group size {group} is not a multiple of {MIN_BLOCK_K}")
    return Int4Weight(pack_int4_along_k(values_kn), zeros.to(torch.uint8).contiguous(),
                      scales.float().contiguous(), group, int(values_kn.shape[0]))


def _read_awq(name: str, tensors: _Tensors, scheme: QuantScheme) -> Int4Weight | None:
    prefix = name.removesuffix("weight")
    if f"{prefix}qweight" not in tensors:
        return None
    qweight, qzeros, scales = (tensors.take(f"{prefix}{s}") for s in ("qweight", "qzeros", "scales"))
    values = _unpack_along_n(qweight, AWQ_ORDER)  # [K, N]
    zeros = _unpack_along_n(qzeros, AWQ_ORDER)
    k, n = values.shape
    if scales.shape != (zeros.shape[0], n) or zeros.shape[1] != n:
        raise ValueError(f"{prefix}scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not fit a "
                         f"[{k}, {n}] AWQ weight")
    return _int4(values, zeros, scales, _groups(k, scales.shape[0], scheme.group_size, prefix + "qweight"), prefix)


def _read_gptq(name: str, tensors: _Tensors, scheme: QuantScheme) -> Int4Weight | None:
    prefix = name.removesuffix("weight")
    if f"{prefix}qweight" not in tensors:
        return None
    qweight, qzeros, scales = (tensors.take(f"{prefix}{s}") for s in ("qweight", "qzeros", "scales"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    zeros = _unpack_along_n(qzeros) + scheme.gptq_zero_offset
    if scales.shape != (zeros.shape[0], n) or zeros.shape[1] != n:
        raise ValueError(f"{prefix}scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not fit a "
                         f"[{k}, {n}] GPTQ weight")
    group = _groups(k, scales.shape[0], scheme.group_size, prefix + "qweight")
    if f"{prefix}g_idx" in tensors:
        g_idx = tensors.take(f"{prefix}g_idx")
        if not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ValueError(f"{prefix}g_idx is permuted (GPTQ act-order), which is not supported")
    return Int4Weight(qweight.contiguous(), zeros.to(torch.uint8), scales.float().contiguous(), group, k)


def _read_pack_quantized(name: str, tensors: _Tensors, scheme: QuantScheme) -> Int4Weight | None:
    if f"{name}_packed" not in tensors:
        return None
    if f"{name}_g_idx" in tensors:
        raise ValueError(f"{name}_g_idx: compressed-tensors act-order (a permuted g_idx) is not supported")
    packed, scales = tensors.take(f"{name}_packed"), tensors.take(f"{name}_scale")
    shape = tuple(int(v) for v in tensors.take(f"{name}_shape").tolist()) if f"{name}_shape" in tensors else None
    n, k = shape if shape is not None else (packed.shape[0], packed.shape[1] * 8)
    values = _unpack_along_n(packed)[:, :k].t()  # [N, K] along K, the same nibble order -> [K, N]
    groups = scales.shape[1] if scales.dim() == 2 else 1
    scales = scales.reshape(n, groups)
    if f"{name}_zero_point" in tensors:
        point = tensors.take(f"{name}_zero_point")
        if tuple(point.shape) == (-(-n // 8), groups) and point.dtype == torch.int32:
            zeros = _unpack_along_n(point.t().contiguous())[:, :n].t()  # packed along N: unsigned = signed + 8
        elif tuple(point.shape) in ((n, groups), (n,)):
            zeros = point.reshape(n, groups).long() + 8
        else:
            raise ValueError(f"{name}_zero_point has shape {tuple(point.shape)}, expected packed "
                             f"[{-(-n // 8)}, {groups}] or [{n}, {groups}]")
    else:
        zeros = torch.full((n, groups), 8, dtype=torch.long)  # symmetric: signed values, stored + 8
    return _int4(values.contiguous(), zeros.t(), scales.t(), _groups(k, groups, scheme.group_size, name), name)


@dataclass(frozen=True)
class Mxfp4Tensor:
    """A gpt-oss expert stack as stored: blocks [E, out, in/32, 16], scales [E, out, in/32]."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """[E, in, out] float32: the layout the full-precision checkpoint's tensor of that name has."""
        return dequantize_mxfp4(self.blocks, self.scales).transpose(-1, -2)


def _read_mxfp4(name: str, tensors: _Tensors) -> Mxfp4Tensor | None:
    if f"{name}_blocks" not in tensors:
        return None
    blocks, scales = tensors.take(f"{name}_blocks"), tensors.take(f"{name}_scales")
    check_mxfp4(blocks, scales, name)
    if blocks.dim() != 4:
        raise ValueError(f"{name}_blocks has shape {tuple(blocks.shape)}; MXFP4 is read for stacked experts "
                         "[E, out, in/32, 16] only")
    return Mxfp4Tensor(blocks, scales)


def _read(name: str, tensors: _Tensors, scheme: QuantScheme) -> QuantWeight | Mxfp4Tensor | None:
    """`name`'s quantized form in the checkpoint (linear weights repacked for the kernels), else None."""
    if scheme.method in ("fp8", "fbgemm_fp8"):
        return _read_fp8(name, tensors, scheme)
    if scheme.method == "awq":
        return _read_awq(name, tensors, scheme)
    if scheme.method == "gptq":
        return _read_gptq(name, tensors, scheme)
    if scheme.method == "mxfp4":
        return _read_mxfp4(name, tensors)
    return _read_fp8(name, tensors, scheme) or _read_pack_quantized(name, tensors, scheme)


# ---------------------------------------------------------------- the module and the load


class QuantLinear(nn.Module):
    """A linear layer of a quantized weight: y = x @ W^T + bias through `kernels.quant_gemm`. The
    kernel-layout tensors are also registered as buffers, so they count in the module's memory; it is
    built on its device and never moved or cast (`quant` holds those tensors, which `.to()` would not
    update, and its scales must stay fp32)."""

    def __init__(self, weight: QuantWeight, bias: nn.Parameter | None) -> None:
        from radixserve.kernels.quant_gemm import quant_linear  # imports triton: only where the kernels run

        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.quant = weight
        self._linear = quant_linear
        fields = ("weight", "scale") if isinstance(weight, Fp8Weight) else ("qweight", "zeros", "scales")
        for field in fields:
            self.register_buffer(field, getattr(weight, field), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self._linear(x.reshape(-1, self.in_features), self.quant, self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "fp8" if isinstance(self.quant, Fp8Weight) else f"int4 g{self.quant.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, bias={self.bias is not None}"


@torch.no_grad()
def load_quantized_weights(model: nn.Module, files: list[Path], scheme: QuantScheme,
                           use_kernels: bool | None = None) -> None:
    """Fill `model` (a CausalLM) from a quantized checkpoint. `use_kernels`: turn fully quantized linear
    layers into QuantLinear (default: when the model is on CUDA); else dequantize them at load."""
    from radixserve.model.loader import _few, _ignorable, checkpoint_targets

    device = next(model.parameters()).device
    use_kernels = device.type == "cuda" if use_kernels is None else use_kernels
    targets = checkpoint_targets(model)  # type: ignore[arg-type]
    modules = dict(model.named_modules())
    with ExitStack() as stack:
        tensors = _Tensors(files, stack)
        found = {name: got for name in targets if (got := _read(name, tensors, scheme)) is not None}
        kernel_params = _kernel_params(targets, found, modules) if use_kernels else set()
        for param in kernel_params:
            pieces = sorted(((t.first_row, found[n]) for n, t in targets.items() if t.param == param),
                            key=lambda piece: piece[0])
            module_name = param.removesuffix(".weight")
            linear = modules[module_name]
            assert isinstance(linear, nn.Linear)
            fused = concat_rows([p for _, p in pieces if not isinstance(p, Mxfp4Tensor)])
            if fused.shape != (linear.out_features, linear.in_features):
                raise ValueError(f"quantized {module_name} has shape {fused.shape}, the config implies "
                                 f"{(linear.out_features, linear.in_features)}")
            parent, _, leaf = module_name.rpartition(".")
            setattr(modules[parent] if parent else model, leaf, QuantLinear(fused.to(device), linear.bias))
        if use_kernels:
            kernel_params |= _mxfp4_experts(targets, found, modules, device)
        params = dict(model.named_parameters())
        loaded: set[str] = set()
        dequantized = 0
        for name, target in targets.items():
            if target.param in kernel_params:
                loaded.add(name)
                continue
            got = found.get(name)
            if got is not None:
                tensor = got.dequantize() if isinstance(got, Mxfp4Tensor) else dequantize(got)
                dequantized += 1
            elif name in tensors:
                tensor = tensors.take(name)
            else:
                continue
            _place(params, target, tensor, name, tensors.file_of.get(name, "checkpoint"))
            loaded.add(name)
        # a calibrated FP8 KV cache's scales: our cache keeps its own format (--kv-cache-dtype)
        kv_scales = KV_SCALES if scheme.kv_scales else ()
        unexpected = sorted(n for n in tensors.unused()
                            if not _ignorable(n, model.spec) and not n.endswith(kv_scales))  # type: ignore[arg-type]
    if unexpected:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {_few(unexpected)}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors: {_few(missing)}")
    dtype = next(iter(params.values())).dtype
    if kernel_params:
        log.info("quantized checkpoint (%s): %d weights run quantized in the Triton kernels, %d dequantized to %s "
                 "at load", scheme.description, len(kernel_params), dequantized, dtype)
    else:
        log.info("quantized checkpoint (%s): %d weights dequantized to %s at load (no CUDA: the Triton kernels "
                 "need a GPU)", scheme.description, dequantized, dtype)


def _mxfp4_experts(targets: dict[str, Any], found: dict[str, Any], modules: dict[str, nn.Module],
                   device: torch.device) -> set[str]:
    """Hand every MoE layer whose gate_up and down stacks are both MXFP4 its `Mxfp4Experts` (the fused
    MXFP4 kernels run them) in place of the stacked parameters; returns the parameters so replaced."""
    from radixserve.model.moe import MoE

    by_param = {t.param: found.get(name) for name, t in targets.items() if t.expert is None}
    replaced: set[str] = set()
    for module_name, module in modules.items():
        gate_up, down = by_param.get(f"{module_name}.gate_up"), by_param.get(f"{module_name}.down")
        if not isinstance(module, MoE) or not isinstance(gate_up, Mxfp4Tensor) or not isinstance(down, Mxfp4Tensor):
            continue
        # the checkpoint interleaves gate and up rows (gate j at 2j, up j at 2j + 1); ours are gate then up
        blocks = torch.cat((gate_up.blocks[:, 0::2], gate_up.blocks[:, 1::2]), dim=1)
        scales = torch.cat((gate_up.scales[:, 0::2], gate_up.scales[:, 1::2]), dim=1)
        experts = Mxfp4Experts(blocks.to(device), scales.to(device), down.blocks.to(device), down.scales.to(device),
                               module.gate_up_bias, module.down_bias)  # the bias parameters, loaded as plain tensors
        shape = (experts.num_experts, experts.hidden, experts.intermediate)
        if shape != tuple(module.down.shape):
            raise ValueError(f"{module_name}: MXFP4 experts [E, H, I] {shape} do not fit the config's "
                             f"{tuple(module.down.shape)}")
        module.packed = experts
        module.register_parameter("gate_up", None)
        module.register_parameter("down", None)
        replaced |= {f"{module_name}.gate_up", f"{module_name}.down"}
    return replaced


def _kernel_params(targets: dict[str, Any], found: dict[str, Any], modules: dict[str, nn.Module]) -> set[str]:
    """The linear weights every piece of which is quantized in a kernel layout of one kind."""
    pieces: dict[str, list[tuple[str, Any]]] = {}
    for name, target in targets.items():
        pieces.setdefault(target.param, []).append((name, target))
    chosen = set()
    for param, entries in pieces.items():
        module = modules.get(param.removesuffix(".weight"))
        if not param.endswith(".weight") or not isinstance(module, nn.Linear):
            continue
        got = [found.get(name) for name, _ in entries]
        if all(t.expert is None and t.convert is None for _, t in entries) and (
                all(isinstance(g, Fp8Weight) for g in got) or all(isinstance(g, Int4Weight) for g in got)):
            chosen.add(param)
    return chosen


def _place(params: dict[str, nn.Parameter], target: Any, tensor: torch.Tensor, name: str, file: str) -> None:
    dest: torch.Tensor = params[target.param]
    if target.expert is not None:
        dest = dest[target.expert]
    if target.rows is not None:
        dest = dest.narrow(0, target.first_row, target.rows)
    if target.convert is not None:
        tensor = target.convert(tensor)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"{file}: tensor {name} has shape {tuple(tensor.shape)} (dequantized), the config implies "
                         f"{tuple(dest.shape)}")
    dest.copy_(tensor)
