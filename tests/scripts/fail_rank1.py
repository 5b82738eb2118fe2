"""Launched by tests/launch/test_launch.py: rank 1 raises while rank 0 waits in an all_reduce.

Rank 0 then behaves like a rank that does not notice its peer is gone (it catches the broken
collective and sleeps): only the launcher stopping the other ranks can end the run.
"""

import time

import torch
import torch.distributed as dist

from retarget.execution.process import ProcessState

state = ProcessState.current()
if state.rank == 1:
    time.sleep(0.5)  # rank 0 is inside the all_reduce by now
    raise ValueError("rank 1 cannot read shard 7")
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError:
    time.sleep(600)
print("rank 0 finished", flush=True)
