"""retarget: compiler-style rewriting of PyTorch models for training targets.

model = retarget.compile_for(model, target="single", example_inputs=batch)
print(model.report)
"""

from retarget.core.errors import (
    PassError,
    PassOrderError,
    TargetNotSupportedError,
    VerificationError,
)
from retarget.core.version import __version__
from retarget.core.world import launched_target
from retarget.driver.compile import compile_for
from retarget.driver.compiled import CompiledModule
from retarget.passes.base import Pass, PassResult
from retarget.target.errors import ConfigError
from retarget.target.grammar import Target, TargetError, parse_target

#: Names imported on first use: the Accelerate-compatible front door pulls in the whole runtime,
#: and reading Accelerate's config YAML needs PyYAML.
_LAZY_NAMES = {
    "target_from_yaml": "retarget.target.accelerate_yaml",
    "Accelerator": "retarget.accelerate.accelerator",
    "DistributedType": "retarget.accelerate.arguments",
    "GeneralTracker": "retarget.accelerate.trackers",
    **dict.fromkeys(
        (
            "AORecipeKwargs",
            "AutocastKwargs",
            "FP8RecipeKwargs",
            "GradScalerKwargs",
            "MSAMPRecipeKwargs",
            "TERecipeKwargs",
        ),
        "retarget.accelerate.precision_kwargs",
    ),
    **dict.fromkeys(
        (
            "DDPCommunicationHookType",
            "DistributedDataParallelKwargs",
            "InitProcessGroupKwargs",
            "ProfileKwargs",
        ),
        "retarget.accelerate.process_kwargs",
    ),
    "ProjectConfiguration": "retarget.accelerate.arguments",
    "TorchDynamoPlugin": "retarget.accelerate.dynamo",
    # accelerate's top level offers these utils too; scripts import them from either.
    "find_executable_batch_size": "retarget.utils.memory",
    "debug_launcher": "retarget.utils.launchers",
    "notebook_launcher": "retarget.utils.launchers",
    "init_empty_weights": "retarget.bigmodel.empty_init",
    "init_on_device": "retarget.bigmodel.empty_init",
    "infer_auto_device_map": "retarget.bigmodel.device_map",
    "load_checkpoint_in_model": "retarget.bigmodel.load_checkpoint",
    "load_checkpoint_and_dispatch": "retarget.bigmodel.dispatch_checkpoint",
    "watch_preemption": "retarget.runtime.preemption",
    "resume_from_latest": "retarget.runtime.state.checkpoint",
    **dict.fromkeys(
        ("dispatch_model", "cpu_offload", "disk_offload", "cpu_offload_with_hook"),
        "retarget.bigmodel.dispatch",
    ),
    "DeviceMap": "retarget.core.placement",
}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'retarget' has no attribute {name!r}")


__all__ = [
    *_LAZY_NAMES,
    "CompiledModule",
    "ConfigError",
    "Pass",
    "PassError",
    "PassOrderError",
    "PassResult",
    "Target",
    "TargetError",
    "TargetNotSupportedError",
    "VerificationError",
    "__version__",
    "compile_for",
    "launched_target",
    "parse_target",
]
