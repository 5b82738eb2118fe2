"""save_model / get_state_dict / load_model: the trained weights, full and unsharded, for anyone.

A checkpoint (save_state) is for resuming this run; `save_model` is for using the weights
elsewhere: one set of full tensors with the model's own state_dict keys, whatever target it was
trained under (DDP's `module.` prefix and FSDP's shards are gone), in Hugging Face's layout
with Accelerate's file names:

    model.safetensors                   all tensors, when they fit in max_shard_size bytes
or
    model-00001-of-00002.safetensors    shards of at most max_shard_size bytes of tensors
    model-00002-of-00002.safetensors
    model.safetensors.index.json        {"metadata": {"total_size": n}, "weight_map": {key: shard}}
and
    config.json                         when the model has a Hugging Face config

so `AutoModel.from_pretrained(dir)` loads it, and so does `load_model(plain_model, dir)`.
Tied weights (GPT-2's `lm_head.weight` is `transformer.wte.weight`) are saved once, under the
first key in state_dict order, as Hugging Face does; a sharded index's `metadata.tied_weights`
maps each dropped key to the one kept, and `load_model` fills it back in (from the model's
own ties when there is no index).

    >>> save_model(model, "out/llama", max_shard_size="500MB")    # every rank calls it
    >>> load_model(LlamaForCausalLM(config), "out/llama")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from retarget.core.slots import PROGRAM
from retarget.execution import xla_device as xla
from retarget.execution.apply_plan import applied_of
from retarget.execution.process import ProcessState
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.runtime.state.codec import fsync_file
from retarget.targets.values import parse_size as parse_bytes_of

#: File names by format: (shard prefix, extension, index name).
_LAYOUT = {
    True: ("model", "safetensors", "model.safetensors.index.json"),
    False: ("pytorch_model", "bin", "pytorch_model.bin.index.json"),
}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "10GB" / "500MB" (powers of 10) / "2GiB" (powers of 2)."""
    return parse_bytes_of(size, what="max_shard_size", minimum=1)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside the wrappers training added (DDP, torch.compile, compile_for).

    A `CompiledModule` gives back the model passed to compile_for, carrying the current
    weights. FSDP2 adds no wrapper (the module itself is sharded): it comes back as it is.
    """
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif PROGRAM.get(model) is not None:  # a compile_for result (driver.compiled)
            model = model.unwrap()
        else:
            return model


def _peel(model: nn.Module) -> nn.Module:
    # Wrappers that add a key prefix; the compiled module keeps the original keys.
    while isinstance(model, (DistributedDataParallel, torch._dynamo.eval_frame.OptimizedModule)):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def get_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on the CPU, with the model's own keys (no wrapper prefixes).

    Under FSDP the shards are gathered: every rank must call it, and only rank 0 receives
    the tensors (the others get an empty dict, so that N full copies never exist at once).
    Under pp each stage's tensors are its own rank's (the others are emptied there): rank 0
    receives each rank's part (under fsdp+pp gathered whole over the stage's dp ranks first).
    """
    # DCP's module imports DTensor and FSDP (0.7 s): imported when a model is saved
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    xla.settle([model])  # under xla: one sync, not a graph per tensor read out
    applied = applied_of(model)
    if applied is None or applied.pipeline is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    # Under pp a rank holds its stages' tensors only (the others are emptied): each rank
    # sends its own part, and rank 0 puts them in the model's key order.
    plain = _peel(model)
    keys = applied.pipeline.held_keys(plain)
    tensors = plain.state_dict(keep_vars=True)
    own = {  # fsdp+pp: a stage's shards gathered whole over its dp ranks (a collective)
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in tensors.items()
        if k in keys
    }
    state = ProcessState.current()
    parts: list[Any] | None = [None] * state.world_size if state.is_main_process else None
    dist.gather_object(own, parts, dst=0)
    if parts is None:
        return {}
    gathered: dict[str, torch.Tensor] = {}
    for part in parts:
        gathered.update(part)
    return {key: gathered[key] for key in tensors if key in gathered}


def dequantized(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` with each quantized Linear's packed buffer replaced by its (out, in) weight in
    the dtype the weight had: the files hold the model's own layout, which any loader reads
    (the quantization is redone at load time: load_and_quantize_model, or the quant target)."""
    for path, module in _peel(model).named_modules():
        key = f"{path}.weight" if path else "weight"
        if isinstance(module, QuantizedLinear) and key in full:
            full[key] = module.dequantized_from(full[key])
    return full


def tied_weights(model: nn.Module) -> dict[str, str]:
    """Keys whose tensor is another key's tensor, mapped to the first such key."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key, tensor in _peel(model).state_dict(keep_vars=True).items():
        if id(tensor) in first:
            tied[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return tied


def _plan_shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Keys grouped into shards of at most `limit` bytes, as Hugging Face Hub's
    `split_torch_state_dict_into_shards` groups them (so Accelerate names the same files): in
    order, a shard closed when the next tensor would overflow it, a tensor bigger than the
    limit in a shard of its own, placed before the shard being filled."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > limit:
            shards.append([key])
            continue
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, safe: bool = True) -> list[str]:
    """Accelerate's file names: one shard is `model.safetensors` (`pytorch_model.bin`),
    several are `model-0000k-of-0000n.safetensors`."""
    prefix, ext, _ = _LAYOUT[safe]
    if count == 1:
        return [f"{prefix}.{ext}"]
    return [f"{prefix}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def save_model(
    model: nn.Module,
    save_directory: str | Path,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> Path:
    """Write the full weights as one file or shards plus an index (and config.json for HF
    models), named as Accelerate's save_model names them.

    Call it on every rank (FSDP gathers); rank 0 writes. Shards left in the folder by an
    earlier save_model with another shard count are removed. `safe_serialization=False`
    writes `pytorch_model.bin` / `pytorch_model-*.bin` (torch.save) instead of safetensors.
    """
    limit = parse_size(max_shard_size)
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_model: {directory} is a file; give a folder")
    state = ProcessState.current()
    full = dequantized(model, get_state_dict(model))
    tied = tied_weights(model)
    if state.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v for k, v in full.items() if k not in tied}
        _write_shards(directory, tensors, limit, safe_serialization, tied)
        # Not unwrap_model: under FSDP unwrapping gathers (a collective) and only rank 0 is here.
        config = getattr(_peel(model), "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
    state.wait_for_everyone()
    return directory


def _write_shards(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    limit: int,
    safe: bool,
    tied: dict[str, str],
) -> None:
    prefix, ext, index_name = _LAYOUT[safe]
    plan = _plan_shards(tensors, limit)
    names = shard_names(len(plan), safe)
    # Files of an earlier save with another shard count would be read with the new ones.
    for stale in [*directory.glob(f"{prefix}*.{ext}"), directory / index_name]:
        if stale.name not in names and stale.is_file():
            stale.unlink()
    weight_map: dict[str, str] = {}
    for name, keys in zip(names, plan, strict=True):
        # Copies: safetensors refuses views that share memory, and this bounds the memory
        # held at once to one shard.
        shard = {k: tensors[k].detach().contiguous().clone() for k in keys}
        path = directory / name
        if safe:
            save_file(shard, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
        fsync_file(path)
        weight_map |= dict.fromkeys(keys, name)
    if len(plan) == 1:  # no index for one file, as Accelerate and Hugging Face write it
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    metadata: dict[str, Any] = {"total_size": total}
    if tied:
        metadata["tied_weights"] = tied
    index = {"metadata": metadata, "weight_map": weight_map}
    (directory / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def read_model_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The state dict save_model wrote (one file, or shards and their index), with the tied
    keys the index records filled in; no pickle is loaded (torch.load(weights_only=True))."""
    directory = Path(directory)
    for safe in (True, False):
        prefix, ext, index_name = _LAYOUT[safe]
        single = directory / f"{prefix}.{ext}"
        if (directory / index_name).is_file() or single.is_file():
            break
    else:
        raise FileNotFoundError(
            f"{directory} has no model.safetensors, pytorch_model.bin or an index "
            f"({_LAYOUT[True][2]}, {_LAYOUT[False][2]}): not a folder written by save_model"
        )
    index: dict[str, Any] = {"weight_map": {"*": single.name}}
    if (directory / index_name).is_file():
        index = json.loads((directory / index_name).read_text())
    state: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(index["weight_map"].values()):
        path = directory / name
        state |= load_file(path) if safe else torch.load(path, weights_only=True)
    for alias, kept in index.get("metadata", {}).get("tied_weights", {}).items():
        state[alias] = state[kept]
    return state


def load_model(model: nn.Module, directory: str | Path, *, strict: bool = True) -> nn.Module:
    """Load weights written by save_model into an unsharded `model`; returns it. Keys tied in
    `model` (saved once) are filled from the key kept."""
    state = read_model_weights(directory)
    for alias, kept in tied_weights(model).items():
        if alias not in state and kept in state:
            state[alias] = state[kept]
    model.load_state_dict(state, strict=strict)
    return model
