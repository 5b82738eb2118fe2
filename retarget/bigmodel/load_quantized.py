"""Quantize a model as it loads: the Linears the quant rule table picks become QuantizedLinear
and their weights are read from the checkpoint one tensor at a time.

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model = quantize_model(model, QuantizeSettings(format="nf4"), "path/to/checkpoint")

The model's tensors start on the meta device (`init_empty_weights`); each chosen Linear is
replaced by a QuantizedLinear holding a meta buffer; then every tensor of the checkpoint is read
alone (headers first: `bigmodel/checkpoint_files.py`) and set into the model; a chosen weight
is read from the file and quantized one chunk of 64K weights at a time
(`kernels/quant/formats.py`), so its float form never exists whole. At any moment memory holds
the model loaded so far plus one unquantized tensor or one chunk: peak memory stays near the
quantized model's size, never the float model's. A model already holding its weights is
quantized in place (a float copy then exists until the swap, as in Accelerate).

The choice is `passes/precision/quant_rules.py`'s (output head, tied weights, adapters and
`skip` kept); `keep_fp32` names modules kept unquantized and in float32. The packed buffers are
stored as float32 (the dtype PEFT's `prepare_model_for_kbit_training` leaves alone: it casts
float16/bfloat16 parameters to float32, which would change the bytes of a buffer stored as
either); `compile_for` re-stores them in FSDP's gather dtype when it shards them.
Every key of the model must be in the checkpoint and every checkpoint key must be in the model
(tied keys saved once are aliases), or nothing is kept half-loaded: CheckpointError names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from retarget.bigmodel.checkpoint_files import find_checkpoint, tensor_reader
from retarget.core.errors import CheckpointError
from retarget.kernels.quant.formats import BITS, QuantLayout
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.passes.precision.fp8_rules import names
from retarget.passes.precision.quant_rules import decide_all


@dataclass(frozen=True, kw_only=True)
class QuantizeSettings:
    format: str = "nf4"
    """nf4 | fp4 | int8."""
    block_size: int = 64
    double_quant: bool = False
    compute_dtype: torch.dtype | None = None
    """The dtype of the dequantized matmul (None: the input's)."""
    dtype: torch.dtype | None = None
    """The dtype of the tensors that stay unquantized (None: as the model has them)."""
    skip: tuple[str, ...] = ()
    """Modules never quantized (patterns, as quant[skip=...])."""
    keep_fp32: tuple[str, ...] = ()
    """Modules never quantized and kept in float32."""


def quantize_model(
    model: nn.Module, settings: QuantizeSettings, weights_location: str | None = None
) -> list[str]:
    """Swap the chosen Linears of `model` (in place) and load `weights_location` into it;
    returns the paths quantized."""
    skip = (*settings.skip, *settings.keep_fp32)
    chosen = [d.path for d in decide_all(model, skip) if d.quantized]
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and weights_location is None:
        raise CheckpointError(
            "the model is on the meta device (init_empty_weights) and no weights_location was "
            "given: give the checkpoint to load, or build the model with its weights"
        )
    files = find_checkpoint(weights_location) if weights_location is not None else None
    if files is not None:
        _check_keys(model, files)
    for path in chosen:
        linear = model.get_submodule(path)
        layout = QuantLayout(
            settings.format,
            (linear.out_features, linear.in_features),
            settings.block_size,
            settings.double_quant and BITS[settings.format] == 4,
        )
        module = QuantizedLinear(
            linear, layout, storage_dtype=torch.float32, compute_dtype=settings.compute_dtype
        )
        model.set_submodule(path, module)
    if files is not None:
        _load(model, files, settings)
    _cast_rest(model, settings)
    return chosen


def _check_keys(model: nn.Module, files) -> None:
    keys = set(model.state_dict())
    stored = set(files.tensors) | set(files.aliases)
    missing, unexpected = sorted(keys - stored), sorted(stored - keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{files.origin}: the checkpoint does not match the model: missing "
            f"{missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'}; nothing was loaded"
        )


def _load(model: nn.Module, files, settings: QuantizeSettings) -> None:
    with tensor_reader() as reader:
        for key, stored in files.tensors.items():
            path, _, name = key.rpartition(".")
            module = model.get_submodule(path)
            if isinstance(module, QuantizedLinear) and name == "weight":
                # Read and quantized a chunk at a time: the float weight never exists whole.
                module.load_weight_from(
                    lambda start, count, stored=stored: reader.read_range(stored, start, count),
                    "cpu",
                )
                continue
            _set(module, name, reader.read(stored))
        for alias, kept in files.aliases.items():
            path, _, name = alias.rpartition(".")
            kept_path, _, kept_name = kept.rpartition(".")
            source = model.get_submodule(kept_path)
            tensor = source._parameters.get(kept_name, source._buffers.get(kept_name))
            target = model.get_submodule(path)
            if name in target._parameters:
                target._parameters[name] = tensor
            else:
                target._buffers[name] = tensor
    left = [k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta]
    if left:
        raise CheckpointError(f"{files.origin}: no value was loaded for {left[:5]}")


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._parameters:
        old = module._parameters[name]
        requires_grad = old.requires_grad if old is not None else value.is_floating_point()
        if not value.is_floating_point():
            requires_grad = False
        module._parameters[name] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        module._buffers[name] = value


def _cast_rest(model: nn.Module, settings: QuantizeSettings) -> None:
    """Unquantized floating tensors to `dtype`, those under `keep_fp32` to float32."""
    for path, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            targets = [("bias", module.bias)] if module.bias is not None else []
        else:
            targets = [*module._parameters.items(), *module._buffers.items()]
        keep = any(names(pattern, path) for pattern in settings.keep_fp32) if path else False
        dtype = torch.float32 if keep else settings.dtype
        if dtype is None:
            continue
        for _name, tensor in targets:
            if tensor is not None and tensor.is_floating_point() and not tensor.is_meta:
                tensor.data = tensor.data.to(dtype)
