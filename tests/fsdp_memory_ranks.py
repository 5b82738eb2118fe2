"""Rank bodies for tests/execution/test_fsdp_memory.py: the tensor storage alive on a rank under
FSDP.

Only torch and retarget.models are imported at the top, so each spawned rank starts quickly.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import torch

from retarget.models import TinyConfig, synthetic_batch, tiny_lm

#: About 0.46 M parameters (1.8 MB in float32): a full copy on a rank is far above the slack.
SHAPE = dict(vocab_size=512, hidden=128, heads=4, layers=2)
TARGETS = ("fsdp", "zero3", "zero2", "hsdp", "fsdp+bf16", "fsdp+ac")
#: Bytes allowed beyond the shards, buffers and batch (small Python-side tensors: RNG states,
#: scalars, the optimizer's step counters).
SLACK = 64 * 1024


def alive_storage_bytes() -> int:
    """Bytes of the distinct CPU storages behind every tensor object alive in this process.

    gc.get_objects sees every Python tensor (parameters, shards, gradients, optimizer state,
    whatever a captured graph, the Program or the original model holds); storages are counted
    once by their address. A DTensor is a wrapper without storage: its local shard is a tensor
    object of its own and counted as such. Meta tensors hold no memory.
    """
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # wrappers (DTensor), tracing's fake tensors
            continue
        if address:
            seen[address] = max(seen.get(address, 0), storage.nbytes())
    return sum(seen.values())


def shard_bound(model: torch.nn.Module, world: int, batch: dict[str, torch.Tensor]) -> int:
    """What one rank may hold: 1/world of every parameter (FSDP2 pads dim 0 to a multiple of
    world), the buffers and the batch whole, and SLACK."""
    params = {id(p): p for p in model.parameters()}.values()
    shards = sum(
        math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * p.element_size() for p in params
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    inputs = sum(t.numel() * t.element_size() for t in batch.values())
    return shards + buffers + inputs + SLACK


def _one_step(compiled, optimizer, batch) -> None:
    loss = compiled(**batch)["loss"]
    compiled.runtime.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def memory_rank(rank: int, world: int, folder: str) -> dict[str, object]:
    """Per target: bytes alive after compile_for, after a step, after save_state + load_state;
    then whether unwrap(), unwrap_model and save_model give the trained weights bitwise."""
    import retarget
    from retarget.execution.process import ProcessState
    from retarget.runtime.state.checkpoint import load_state, save_state

    ProcessState.current()
    out: dict[str, object] = {}
    for target in TARGETS:
        baseline = alive_storage_bytes()
        torch.manual_seed(0)
        model = tiny_lm(**SHAPE)
        batch = synthetic_batch(TinyConfig(**SHAPE), 2, 16, generator=torch.Generator())
        bound = shard_bound(model, world, batch)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        # Built on the original's parameters before compile_for, as Accelerate users do; a
        # backward before compile_for leaves full-size gradients on them.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(**batch)["loss"].backward()
        compiled = retarget.compile_for(model, target, example_inputs=batch)
        optimizer = compiled.runtime.prepare(optimizer)
        held = {"compiled": alive_storage_bytes() - baseline}
        _one_step(compiled, optimizer, batch)
        held["step"] = alive_storage_bytes() - baseline
        where = Path(folder) / target
        save_state(where, model=compiled, optimizers=[optimizer])
        load_state(where, model=compiled, optimizers=[optimizer])
        held["resumed"] = alive_storage_bytes() - baseline
        out[target] = {"held": held, "bound": bound, "full": full}
        if target == "fsdp+bf16":
            out["weights"] = _weights_come_back(compiled, model, optimizer, batch, folder)
        del model, compiled, optimizer
    out["accelerator"] = _through_accelerator(folder)
    return out


def _through_accelerator(folder: str) -> dict[str, object]:
    """retarget.Accelerator with an FSDP plugin: shards only after prepare and a step, and its
    unwrap_model and save_model give get_state_dict's weights."""
    from safetensors.torch import load_file

    from retarget import Accelerator

    rank = torch.distributed.get_rank()
    baseline = alive_storage_bytes()
    accelerator = Accelerator(fsdp_plugin={})
    torch.manual_seed(0)
    original = tiny_lm(**SHAPE)
    batch = synthetic_batch(TinyConfig(**SHAPE), 2, 16, generator=torch.Generator())
    bound = shard_bound(original, torch.distributed.get_world_size(), batch)
    model, optimizer = accelerator.prepare(original, torch.optim.SGD(original.parameters(), 0.1))
    accelerator.backward(model(**batch)["loss"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    result = {"target": str(model.program.target), "held": alive_storage_bytes() - baseline}
    result["bound"] = bound
    expected = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    result["unwrap_model bitwise"] = rank != 0 or (
        unwrapped is original and _bitwise(unwrapped.state_dict(), expected)
    )
    saved = Path(folder) / "accelerator"
    accelerator.save_model(model, saved)
    if rank == 0:
        on_disk = {k: v for f in saved.glob("*.safetensors") for k, v in load_file(f).items()}
        result["save_model bitwise"] = _bitwise(on_disk, expected, skip_missing=True)
    return result


def _weights_come_back(compiled, model, optimizer, batch, folder: str) -> dict[str, bool]:
    """unwrap(), Accelerate's unwrap_model and save_model all give get_state_dict's weights."""
    from safetensors.torch import load_file

    import retarget
    from retarget.core.errors import TargetNotSupportedError
    from retarget.core.modules import released
    from retarget.runtime.state.save_model import get_state_dict, save_model, unwrap_model

    rank = torch.distributed.get_rank()
    _one_step(compiled, optimizer, batch)
    expected = get_state_dict(compiled)  # full tensors on rank 0, {} elsewhere
    big = [p for p in model.parameters() if p.numel() > 1]
    result = {"original emptied while training": all(released(p) for p in big)}
    try:
        retarget.compile_for(model, "fsdp", example_inputs=batch)
        result["emptied model refused"] = False
    except TargetNotSupportedError as err:
        result["emptied model refused"] = "call unwrap() on that compiled model" in str(err)
    unwrapped = compiled.unwrap()  # every rank calls it: it gathers
    result["unwrap is the original"] = unwrapped is model
    result["unwrap fills it"] = not any(released(p) for p in big)
    result["unwrap bitwise"] = rank != 0 or _bitwise(unwrapped.state_dict(), expected)
    _one_step(compiled, optimizer, batch)  # weights move on: a second unwrap must follow them
    expected = get_state_dict(compiled)
    again = unwrap_model(compiled)  # Accelerator.unwrap_model's path; gathers on every rank
    result["unwrap_model bitwise"] = rank != 0 or _bitwise(again.state_dict(), expected)
    saved = save_model(compiled, Path(folder) / "saved")
    if rank == 0:
        files = sorted(saved.glob("*.safetensors"))
        on_disk = {k: v for f in files for k, v in load_file(f).items()}
        result["save_model bitwise"] = _bitwise(on_disk, expected, skip_missing=True)
    # Running the unwrapped model in this process works on the gathered weights.
    result["unwrapped runs"] = bool(torch.isfinite(unwrapped(**batch)["loss"]))
    return result


def _bitwise(state: dict, expected: dict, *, skip_missing: bool = False) -> bool:
    keys = [k for k in expected if k in state] if skip_missing else list(expected)
    return set(state) <= set(expected) and all(
        torch.equal(state[k].detach().cpu(), expected[k]) for k in keys
    )


def sharding_rank(rank: int, world: int) -> dict[str, int]:
    """The most tensor storage alive while compile_for shards (after each fully_shard call),
    beyond what was alive before the model was built, and the model's full bytes."""
    import torch.distributed.fsdp as fsdp

    import retarget
    from retarget.execution.process import ProcessState

    ProcessState.current()
    baseline = alive_storage_bytes()
    torch.manual_seed(0)
    model = tiny_lm(**SHAPE)
    batch = synthetic_batch(TinyConfig(**SHAPE), 2, 16, generator=torch.Generator())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    seen: list[int] = []
    real = fsdp.fully_shard

    def counted(module, **kwargs):  # the real fully_shard, then a count of what is alive
        result = real(module, **kwargs)
        seen.append(alive_storage_bytes() - baseline)
        return result

    fsdp.fully_shard = counted
    try:
        retarget.compile_for(model, "fsdp", example_inputs=batch)
    finally:
        fsdp.fully_shard = real
    return {"peak": max(seen), "units": len(seen), "full": full}
