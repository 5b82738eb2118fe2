"""Accelerate's context parallelism spelled as its users spell it: ParallelismConfig(cp_size=2)
with a cp_comm_strategy, `maybe_context_parallel(buffers=..., buffer_seq_dims=...)` around the
step, `context_parallel_rank`; on 2 gloo ranks the losses of a few SGD steps equal one
process's on the whole sequence, and every rank reads the same batches."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.passes.shard.test_context_parallel import batch, build

STEPS = 3


def _loop(rank: int, world: int) -> dict:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchContextParallelConfig

    from retarget import Accelerator

    config = ParallelismConfig(
        cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="allgather")
    )
    accelerator = Accelerator(parallelism_config=config)
    reference = build("llama")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = build("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    whole = batch(seed=200, rows=2 * STEPS)["input_ids"]
    samples = [{"input_ids": row, "labels": row.clone()} for row in whole]
    loader = torch.utils.data.DataLoader(samples, batch_size=2)
    data = [
        {k: v[2 * i : 2 * i + 2] for k, v in batch(seed=200, rows=2 * STEPS).items()}
        for i in range(STEPS)
    ]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ours, theirs, seen = [], [], []
    for step, item in enumerate(loader):
        buffers = [item["input_ids"], item["labels"]]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1]):
            loss = model(**item).loss
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ours.append(float(loss))
        seen.append(int(item["input_ids"][0, 0]))
        loss = reference(**data[step]).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(float(loss))
    return {
        "target": str(accelerator.target),
        "cp_rank": accelerator.context_parallel_rank,
        "ours": ours,
        "theirs": theirs,
        "seen": seen,
    }


@pytest.mark.distributed
def test_parallelism_config_cp_size_trains_as_one_process():
    results = run_ranks(_loop, 2, timeout=300)
    assert [r["cp_rank"] for r in results] == [0, 1]
    assert results[0]["seen"] == results[1]["seen"]  # a cp group reads one batch
    for r in results:
        assert r["target"] == "fsdp+cp[attention=allgather,size=2]"
        for a, b in zip(r["ours"], r["theirs"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
