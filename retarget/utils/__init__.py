"""`retarget.utils`: Accelerate's `accelerate.utils` helpers that training scripts import.

    from retarget.utils import set_seed, find_executable_batch_size, LocalSGD, gather_object

Each keeps Accelerate's signature and meaning; where one differs or refuses an argument, its
docstring says so. This layer sits between the Accelerate front door and the runtime: it may
use the runtime, launch and big-model layers, and `retarget.accelerate` does not import it.
"""

from retarget.bigmodel.load_checkpoint import load_checkpoint_in_model
from retarget.utils.launchers import debug_launcher, notebook_launcher
from retarget.utils.local_sgd import LocalSGD
from retarget.utils.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)
from retarget.utils.multiprocess_logging import MultiProcessAdapter, get_logger
from retarget.utils.operations import broadcast_object_list, gather_object
from retarget.utils.seeding import set_seed

__all__ = [
    "LocalSGD",
    "MultiProcessAdapter",
    "broadcast_object_list",
    "clear_device_cache",
    "debug_launcher",
    "find_executable_batch_size",
    "gather_object",
    "get_logger",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "release_memory",
    "set_seed",
    "should_reduce_batch_size",
]
