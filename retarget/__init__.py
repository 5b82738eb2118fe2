"""retarget: compiler-style rewriting of PyTorch models for training targets.

    model = retarget.compile_for(model, target="single", example_inputs=batch)
    print(model.report)

`__all__` is the compiler's API: `compile_for` and what it returns, the target language, the
pass contract, and the errors and warnings a user of them meets. The Accelerate-compatible
surface (`retarget.Accelerator`, its kwargs handlers and plugins, Accelerate's top-level utils)
lives in `retarget.compat.accelerate` and is importable from here as well, under Accelerate's
names (`from retarget import Accelerator`), imported on first use.
"""

from retarget.core.version import __version__

#: The compiler's names, imported on first use: `import retarget` itself loads nothing heavy
#: (not torch), so `retarget --help` and a script's start stay fast.
_COMPILER = {
    **dict.fromkeys(
        (
            "EagerRegionWarning",
            "PassError",
            "PassOrderError",
            "RegionCompileError",
            "TargetNotSupportedError",
            "UncompiledRegionWarning",
            "VerificationError",
        ),
        "retarget.core.errors",
    ),
    "launched_target": "retarget.core.world",
    "compile_for": "retarget.driver.compile",
    "CompiledModule": "retarget.driver.compiled",
    "Pass": "retarget.passes.base",
    "PassResult": "retarget.passes.base",
    "ConfigError": "retarget.targets.errors",
    "Target": "retarget.targets.grammar",
    "TargetError": "retarget.targets.grammar",
    "parse_target": "retarget.targets.grammar",
}
#: Compiler names that pull in heavier layers still.
_LAZY_COMPILER = {
    **_COMPILER,
    "OptimizerNotPrepared": "retarget.execution.step_guard",
    "XlaRecompileWarning": "retarget.execution.xla_placement",
    "CheckpointError": "retarget.core.errors",
}
#: Accelerate's names, from their compat home (the front door pulls in the whole runtime, and
#: reading Accelerate's config YAML needs PyYAML).
_ACCELERATE = "retarget.compat.accelerate"
_LAZY_ACCELERATE = {
    "target_from_yaml": f"{_ACCELERATE}.config_yaml",
    "Accelerator": f"{_ACCELERATE}.accelerator",
    "DistributedType": f"{_ACCELERATE}.arguments",
    "GeneralTracker": f"{_ACCELERATE}.trackers",
    **dict.fromkeys(
        (
            "AORecipeKwargs",
            "AutocastKwargs",
            "FP8RecipeKwargs",
            "GradScalerKwargs",
            "MSAMPRecipeKwargs",
            "TERecipeKwargs",
        ),
        f"{_ACCELERATE}.precision_kwargs",
    ),
    **dict.fromkeys(
        (
            "DDPCommunicationHookType",
            "DistributedDataParallelKwargs",
            "InitProcessGroupKwargs",
            "ProfileKwargs",
        ),
        f"{_ACCELERATE}.process_kwargs",
    ),
    "ProjectConfiguration": f"{_ACCELERATE}.arguments",
    "TorchDynamoPlugin": f"{_ACCELERATE}.dynamo",
    # accelerate's top level offers these utils too; scripts import them from either.
    "find_executable_batch_size": f"{_ACCELERATE}.utils.memory",
    "debug_launcher": f"{_ACCELERATE}.utils.launchers",
    "notebook_launcher": f"{_ACCELERATE}.utils.launchers",
    "init_empty_weights": "retarget.bigmodel.empty_init",
    "init_on_device": "retarget.bigmodel.empty_init",
    "infer_auto_device_map": "retarget.passes.place.device_map",
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
_LAZY_NAMES = {**_LAZY_COMPILER, **_LAZY_ACCELERATE}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        import importlib

        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'retarget' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


__all__ = [
    # compiling
    "compile_for",
    "CompiledModule",
    "launched_target",
    # the target language
    "Target",
    "parse_target",
    # the pass contract
    "Pass",
    "PassResult",
    # errors and warnings
    "CheckpointError",
    "ConfigError",
    "EagerRegionWarning",
    "OptimizerNotPrepared",
    "PassError",
    "PassOrderError",
    "RegionCompileError",
    "TargetError",
    "TargetNotSupportedError",
    "UncompiledRegionWarning",
    "VerificationError",
    "XlaRecompileWarning",
    "__version__",
]
