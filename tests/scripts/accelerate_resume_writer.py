"""Train a small model with the real accelerate.Accelerator (CPU, seed fixed; 1 process, or N
under torchrun: DDP over gloo): save_state after `--save-at` steps into `--checkpoint`, go on
to `--steps`, and write each process's final state to `--final` (`{rank}` in it is replaced).
tests/compat/accelerate/test_accelerate_checkpoints.py continues the checkpoint under retarget
and compares with those final weights. With `--resume FOLDER` it loads that checkpoint instead
(test_checkpoint_export.py: a retarget checkpoint converted to Accelerate's layout) and trains
from `--save-at` to `--steps`. The model, data and loop are in
accelerate_resume_run.py, shared with the retarget side."""

from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerate_resume_run import Counter, batches, make_training, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", help="where to save_state (not with --resume)")
    parser.add_argument("--final", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--safe", type=int, default=1)
    parser.add_argument("--resume", help="a checkpoint folder to continue from")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    # each process its own dropout masks and RNG files; a resumed run must owe nothing to the seed
    set_seed(99 if args.resume else 0, device_specific=True)
    model, optimizer, scheduler = make_training()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = batches(args.steps, accelerator.process_index)
    if args.resume:
        accelerator.load_state(args.resume)
    else:
        train(accelerator, model, optimizer, scheduler, counter, data[: args.save_at])
        accelerator.save_state(args.checkpoint, safe_serialization=bool(args.safe))
    drawn = [random.random(), float(np.random.rand())]  # training draws only from torch's
    train(accelerator, model, optimizer, scheduler, counter, data[args.save_at :])
    final = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save(
        {"weights": final, "counter": counter.n, "step": accelerator.step, "drawn": drawn},
        args.final.format(rank=accelerator.process_index),
    )
    # torch 2.13's gloo aborts an interpreter that exits with a live group now and then
    # ("terminate called without an active exception"): end the group first, as our worker does.
    if torch.distributed.is_initialized():
        accelerator.wait_for_everyone()
        del model, optimizer, scheduler
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
