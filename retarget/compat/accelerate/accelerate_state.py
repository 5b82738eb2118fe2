"""Accelerate's own state, set up beside ours for a script that swapped only some imports.

A script moved from Accelerate by changing `from accelerate import Accelerator` alone still
calls Accelerate's helpers: every Hugging Face example does
`logger = get_logger(__name__)` from `accelerate.logging`, whose `logger.info(...,
main_process_only=False)` raises unless Accelerate's PartialState exists ("You must initialize
the accelerate state..."). So when the script has imported accelerate, the Accelerator builds
Accelerate's PartialState too, through its public constructor: it finds the process group
retarget already made (it never starts a second one) and answers the same rank, world size and
main process. A script that imports nothing from accelerate never imports it here.
"""

from __future__ import annotations

import sys

from retarget.execution.process import ProcessState


def share_state_with_accelerate(state: ProcessState) -> bool:
    """Build Accelerate's PartialState over this process's group when the script imported
    accelerate; True when it did."""
    if "accelerate" not in sys.modules:
        return False
    try:
        from accelerate.state import PartialState
    except Exception:  # an accelerate that does not import: its helpers fail the same way
        return False
    PartialState(cpu=state.device.type == "cpu")
    return True
