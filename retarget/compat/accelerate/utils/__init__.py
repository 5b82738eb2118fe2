"""Accelerate's `accelerate.utils` helpers that training scripts import, reached by users as
`retarget.utils` (an alias of this package):

    from retarget.utils import set_seed, find_executable_batch_size, LocalSGD, gather_object
    from retarget.utils import ProjectConfiguration, DistributedDataParallelKwargs

Every name of retarget's Accelerate surface that `accelerate.utils` also exports is here, so a
script whose `from accelerate.utils import ...` lines are switched keeps working.

Each keeps Accelerate's signature and meaning; where one differs or refuses an argument, its
docstring says so. It may use the runtime and big-model layers; the Accelerator's modules do
not import it.
"""

from retarget.bigmodel.load_checkpoint import load_checkpoint_in_model
from retarget.compat.accelerate.arguments import DistributedType, ProjectConfiguration
from retarget.compat.accelerate.dynamo import TorchDynamoPlugin
from retarget.compat.accelerate.precision_kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from retarget.compat.accelerate.process_kwargs import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from retarget.compat.accelerate.utils.launchers import debug_launcher, notebook_launcher
from retarget.compat.accelerate.utils.local_sgd import LocalSGD
from retarget.compat.accelerate.utils.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)
from retarget.compat.accelerate.utils.multiprocess_logging import MultiProcessAdapter, get_logger
from retarget.compat.accelerate.utils.operations import broadcast_object_list, gather_object
from retarget.compat.accelerate.utils.quantization import (
    BnbQuantizationConfig,
    load_and_quantize_model,
)
from retarget.compat.accelerate.utils.seeding import set_seed
from retarget.passes.place.device_map import infer_auto_device_map

__all__ = [
    # Accelerate's dataclasses and enums, which accelerate.utils exports too
    "AORecipeKwargs",
    "AutocastKwargs",
    "BnbQuantizationConfig",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "MSAMPRecipeKwargs",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TERecipeKwargs",
    "TorchDynamoPlugin",
    # helpers
    "LocalSGD",
    "MultiProcessAdapter",
    "broadcast_object_list",
    "clear_device_cache",
    "debug_launcher",
    "find_executable_batch_size",
    "gather_object",
    "get_logger",
    "infer_auto_device_map",
    "load_and_quantize_model",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "release_memory",
    "set_seed",
    "should_reduce_batch_size",
]
