"""Rank bodies for the memory tests (estimate_memory, checkpoint_blocks).

They live in a module that imports only torch and retarget.models, so each spawned rank starts
in about two seconds (tests.zoo pulls in transformers: several seconds more per rank on a shared
two-core machine)."""

from __future__ import annotations

import torch

from retarget.models import TinyConfig, synthetic_batch, tiny_lm

#: An odd vocabulary: FSDP2 gives rank 0 ceil(129 / 2) = 65 rows of the (tied) embedding.
SHAPE = dict(vocab_size=129, hidden=32, heads=2, layers=2)


def model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    return tiny_lm(**SHAPE), synthetic_batch(TinyConfig(**SHAPE), 2, 16, generator=generator)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard)."""
    seen = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen.setdefault(id(storage), storage.nbytes())
    return sum(seen.values())


def held_by_training(model, loss_fn, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state after one real optimizer step."""
    loss_fn().backward()
    optimizer.step()
    return held_bytes(model, optimizer)


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer's state tensors."""
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": storage_bytes(model.parameters()),
        "gradients": storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": storage_bytes(states),
    }


def fsdp_rank(rank: int, world_size: int) -> dict[str, int]:
    """fully_shard every block and the root, one Adam step, this rank's bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from retarget.execution.process import ProcessState

    ProcessState.current()
    model, batch = model_and_batch()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters())
    return held_by_training(model, lambda: model(**batch)["loss"], optimizer)


def fsdp_bf16_ac_rank(rank: int, world_size: int) -> dict[str, object]:
    """One step under fsdp+bf16 and under fsdp+bf16+ac: are loss and full gradients equal?"""
    import retarget
    from retarget.execution.process import ProcessState

    ProcessState.current()
    steps = {}
    for target in ("fsdp+bf16", "fsdp+bf16+ac"):
        model, batch = model_and_batch()
        compiled = retarget.compile_for(model, target, example_inputs=batch)
        loss = compiled(**batch)["loss"]
        loss.backward()
        grads = {
            name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in compiled.named_parameters()
        }
        steps[target] = (loss.detach(), grads, [r.name for r in compiled.history])
    (loss_a, grads_a, _), (loss_b, grads_b, passes) = steps.values()
    return {
        "equal": torch.equal(loss_a, loss_b)
        and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a),
        "passes": passes,
    }
