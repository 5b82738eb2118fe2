"""Rank-0 loading (`fsdp[cpu_ram_efficient_loading=true]`): only rank 0 holds the whole model.

Contract: the other ranks may hand compile_for a model whose weights are on the meta device (as
transformers' from_pretrained builds it on them under FSDP's environment variables) or any
values at all; after sharding, every rank holds its shards of rank 0's values, and no rank but 0
held the whole model at any point.

Three steps, in the order compile_for meets them:

1. `give_placeholders` (compile_for, ranks other than 0): each meta parameter and buffer gets
   placeholder storage of zeros that takes no memory: a private anonymous mapping, whose pages
   the kernel maps to its one shared zero page on read and allocates only on write. Capture can
   then run the model (reading zeros, so every rank captures the same graphs), and nothing is
   resident.
2. `collect_full` (apply, before fully_shard): rank 0 keeps a reference to each whole parameter;
   buffers, which FSDP2 leaves whole, are broadcast from rank 0 as sync_module_states does.
3. `load_shards` (apply, after every unit is sharded): for each parameter, rank 0 scatters the
   whole tensor over the parameter's own mesh and placements, and each rank copies what it
   receives into its local shard: a rank other than 0 holds its shards and one received chunk.

`transformers_environment()` is what makes from_pretrained load on rank 0 only: the variables
Accelerate's launcher sets for this option (transformers reads them; other ranks stay on meta).
"""

from __future__ import annotations

import mmap
import os

import torch
import torch.distributed as dist
from torch import nn

from retarget.targets.grammar import Target
from retarget.targets.strategies import FSDP_STRATEGIES

#: The variables transformers' from_pretrained reads to load weights on local rank 0 only.
TRANSFORMERS_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def asks_rank0_loading(target: Target) -> bool:
    """Whether the target's sharded part says cpu_ram_efficient_loading=true."""
    part = next((target.get(n) for n in FSDP_STRATEGIES if n in target), None)
    return part is not None and bool(part.get("cpu_ram_efficient_loading"))


def transformers_environment() -> None:
    """Set TRANSFORMERS_ENV in this process (from_pretrained reads it at load time)."""
    for key, value in TRANSFORMERS_ENV.items():
        os.environ.setdefault(key, value)


def give_placeholders(model: nn.Module) -> int:
    """Every meta parameter and buffer of `model` gets zero storage that takes no memory until
    written (see the module docstring); returns how many. Identity and requires_grad are kept."""
    count = 0
    with torch.no_grad():
        for param in {id(p): p for p in model.parameters()}.values():
            if param.is_meta:
                # The same object (an optimizer built on the meta model still finds it): a meta
                # tensor's data cannot be set to a CPU one, but the two objects can be swapped.
                placeholder = nn.Parameter(
                    zero_pages(param.shape, param.dtype), requires_grad=param.requires_grad
                )
                try:
                    torch.utils.swap_tensors(param, placeholder)
                except RuntimeError as error:
                    raise RuntimeError(
                        "cpu_ram_efficient_loading: a meta parameter of the model is held "
                        f"elsewhere and cannot be given placeholder storage ({error}); hand "
                        "compile_for the model as built on the meta device"
                    ) from error
                count += 1
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = zero_pages(buffer.shape, buffer.dtype)
                    count += 1
    return count


def zero_pages(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros backed by a private anonymous mapping: no memory until written."""
    numel = torch.Size(shape).numel()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def collect_full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Before fully_shard: rank 0's whole parameters by name (empty on the other ranks), and
    every rank's buffers made rank 0's."""
    with torch.no_grad():
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)
    if dist.get_rank() != 0:
        return {}
    return {name: param.detach() for name, param in module.named_parameters()}


def load_shards(module: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> int:
    """After fully_shard: each parameter's local shard takes its part of rank 0's value
    (`full`, from collect_full); returns how many parameters were loaded.

    distribute_tensor(src_data_rank=0) scatters rank 0's tensor over each sharded mesh dim (and
    broadcasts over a replicated one, hsdp's): a rank receives only its shard. The whole-sized
    tensor it must pass is zero pages that scatter never writes, so it takes no memory.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    rank = dist.get_rank()
    count = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            if rank == 0:
                whole = full.pop(name).to(device)
            elif device.type == "cpu":
                whole = zero_pages(param.shape, param.dtype)
            else:
                whole = torch.empty(param.shape, dtype=param.dtype, device=device)
            if isinstance(param, DTensor):
                mine = distribute_tensor(
                    whole.contiguous(), param.device_mesh, param.placements, src_data_rank=0
                )
                param.to_local().copy_(mine.to_local())
            else:  # a parameter fully_shard left whole (none today): sent whole
                whole = whole.contiguous() if rank == 0 else whole.clone()
                dist.broadcast(whole, src=0)
                param.copy_(whole)
            count += 1
    return count
