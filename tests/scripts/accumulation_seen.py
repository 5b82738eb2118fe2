"""Launched by tests/launch/test_launch_flags.py: prints what retarget.Accelerator() decided,
one JSON line per rank: the target and the accumulation steps it read from the launch (nothing in
code)."""

import json
import os
import sys

from retarget import Accelerator

accelerator = Accelerator()
seen = {
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "target": str(accelerator.target),
    "mixed_precision": accelerator.mixed_precision,
    "accumulation": accelerator.gradient_accumulation_steps,
    "env": os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
}
sys.stdout.write("SEEN " + json.dumps(seen) + "\n")
sys.stdout.flush()
