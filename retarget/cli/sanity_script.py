"""The script `retarget test` launches (as `accelerate test` runs its own): four checks per rank.

    retarget test --num_processes 2
    # retarget test: 4 checks passed on 2 processes (target ddp): ranks, all_reduce, ...

Run by path under `retarget launch`; each check raises AssertionError naming what it saw, which
fails the rank and so the launch. Rank 0 prints the summary line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from retarget.compat.accelerate.accelerator import Accelerator


def _gather(value: object, world: int) -> list[object]:
    if world == 1:
        return [value]
    found: list[object] = [None] * world
    dist.all_gather_object(found, value)
    return found


def check_ranks(accelerator: Accelerator) -> str:
    ranks = _gather(accelerator.process_index, accelerator.num_processes)
    assert ranks == list(range(accelerator.num_processes)), f"ranks seen: {ranks}"
    return "ranks"


def check_all_reduce(accelerator: Accelerator) -> str:
    total = torch.tensor([float(accelerator.process_index + 1)])
    if accelerator.num_processes > 1:
        dist.all_reduce(total)
    world = accelerator.num_processes
    assert total.item() == world * (world + 1) / 2, f"all_reduce of 1..{world}: {total.item()}"
    return "all_reduce"


def check_data_shard(accelerator: Accelerator) -> str:
    world, size = accelerator.num_processes, 4 * accelerator.num_processes
    loader = accelerator.prepare(DataLoader(list(range(size)), batch_size=2))
    mine = [int(item) for batch in loader for item in batch]
    shards = _gather(mine, world)
    seen = sorted(item for shard in shards for item in shard)  # type: ignore[union-attr]
    assert seen == list(range(size)), f"shards {shards} do not cover 0..{size - 1} once"
    return "data shard"


def check_training_step(accelerator: Accelerator) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.full((2, 4), float(accelerator.process_index + 1))  # differs per rank
    accelerator.backward(model(batch).sum())
    optimizer.step()
    after = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert changed, "the step changed no weight"
    flat = torch.cat([p.flatten() for p in after]).tolist()
    copies = _gather(flat, accelerator.num_processes)
    assert all(copy == copies[0] for copy in copies), "ranks' weights differ after one step"
    return "training step"


def main() -> None:
    accelerator = Accelerator()
    checks = (check_ranks, check_all_reduce, check_data_shard, check_training_step)
    passed = [check(accelerator) for check in checks]
    if accelerator.is_main_process:
        world = accelerator.num_processes
        print(
            f"retarget test: {len(passed)} checks passed on {world} process"
            f"{'es' if world > 1 else ''} (target {accelerator.target}): {', '.join(passed)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
