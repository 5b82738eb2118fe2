"""Launched by tests/launch/test_launch.py: prints, as one JSON line per rank, what the rank sees.

python print_rank.py [--exit CODE] [anything else is echoed back untouched]
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from retarget.core.world import launched_target
from retarget.execution.process import ProcessState

state = ProcessState.current()
total = torch.tensor([float(state.rank)])
if state.distributed:
    dist.all_reduce(total)  # the group is real: every rank sees the sum of the ranks
seen = {
    "rank": state.rank,
    "world": state.world_size,
    "rank_sum": total.item(),
    "target": str(launched_target()),
    "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
    "argv": sys.argv[1:],
    "name": __name__,
    "path0": sys.path[0],
}
# One write per line: the ranks share the launcher's stdout and print's separate "\n" interleaves.
sys.stdout.write("SEEN " + json.dumps(seen) + "\n")
sys.stdout.flush()
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
