"""Which Target an Accelerator trains for, from its arguments, the launch, and the world size.

In order, the distribution comes from: `target=`; else `parallelism_config=` (Accelerate's
N-D sizes, targets/parallelism.py); else `fsdp_plugin=` / `deepspeed_plugin=`
(mapped by the fsdp_config / deepspeed_config tables of config_sections.py, the
same ones that read Accelerate's YAML); else `$RETARGET_TARGET` (set by `retarget launch`);
else `ddp` for more than one process and `single` for one. `torch_tp_plugin=` adds
tp[size=tp_size] to an fsdp_plugin's or the default's distribution. Precision: `mixed_precision=`
replaces the precision parts of a launched target (as Accelerate's argument overrides its
launch config) and must agree with an explicit `target=`; FP8 recipe handlers set the fp8
options. Then the other kwargs handlers (DDP, GradScaler) set their options. Nothing is
dropped: a plugin field, a handler field or a combination the target cannot express
raises, naming the field.

    >>> resolve_target(target=None, mixed_precision="bf16", world_size=2)   # not launched
    Resolution(target=Target('ddp+bf16'), origin='default for 2 processes', ...)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retarget.compat.accelerate.config_sections import read_target_sections
from retarget.compat.accelerate.kwargs_base import KwargsHandler, KwargsHandlerError, TargetDraft
from retarget.compat.accelerate.precision_kwargs import FP8_RECIPES
from retarget.core.world import TARGET_ENV, launched_target
from retarget.execution import xla_device as xla
from retarget.targets.grammar import Target, TargetError, parse_target
from retarget.targets.parallelism import CONTEXT_SIZES, SIZES, parallelism_target
from retarget.targets.precisions import PRECISION_PART_NAMES, PRECISION_PARTS, precision_of

__all__ = ["Resolution", "resolve_target"]


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """The target in effect and where it came from."""

    target: Target
    origin: str
    """What decided the distribution: "target=", "fsdp_plugin", "$RETARGET_TARGET", "default..."."""
    gradient_accumulation_steps: int | None = None
    """Set by a DeepSpeed plugin's gradient_accumulation_steps (None: not set there)."""


# ------------------------------------------------------------------------------ plugins

#: FullyShardedDataParallelPlugin fields -> Accelerate fsdp_config keys.
_FSDP_FIELDS = {
    "fsdp_version": "fsdp_version",
    "sharding_strategy": "fsdp_sharding_strategy",
    "reshard_after_forward": "fsdp_reshard_after_forward",
    "backward_prefetch": "fsdp_backward_prefetch",
    "auto_wrap_policy": "fsdp_auto_wrap_policy",
    "cpu_offload": "fsdp_offload_params",
    "state_dict_type": "fsdp_state_dict_type",
    "use_orig_params": "fsdp_use_orig_params",
    "sync_module_states": "fsdp_sync_module_states",
    "forward_prefetch": "fsdp_forward_prefetch",
    "activation_checkpointing": "fsdp_activation_checkpointing",
    "activation_checkpointing_offload": "fsdp_activation_cpu_offload",
    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "min_num_params": "fsdp_min_num_params",
}
#: Plugin fields with no fsdp_config key: (accepted when, why others are refused).
_FSDP_OWN = {
    "mixed_precision_policy": (
        lambda v, p: v is None,
        "precision comes from mixed_precision= (FSDP's MixedPrecisionPolicy is built from it)",
    ),
    "ignored_modules": (lambda v, p: not v, "every parameter is sharded; none can be ignored"),
    "param_init_fn": (
        lambda v, p: v is None or p.get("cpu_ram_efficient_loading"),
        "param_init_fn is not called: build the model on the CPU (with cpu_ram_efficient_loading "
        "the ranks other than 0 may build it on the meta device)",
    ),
    "limit_all_gathers": (
        lambda v, p: v in (None, True),
        "FSDP2 bounds in-flight all-gathers through its prefetching; it cannot be switched off",
    ),
    "state_dict_config": (
        lambda v, p: v is None or getattr(v, "offload_to_cpu", True),
        "state dicts are always gathered to the CPU",
    ),
    "optim_state_dict_config": (
        lambda v, p: v is None or getattr(v, "offload_to_cpu", True),
        "optimizer state dicts are always gathered to the CPU",
    ),
}
_WRAP_POLICIES = {
    "transformer_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "size_based_auto_wrap_policy": "SIZE_BASED_WRAP",
}

#: DeepSpeedPlugin fields -> Accelerate deepspeed_config keys.
_DEEPSPEED_FIELDS = {
    "zero_stage": "zero_stage",
    "offload_optimizer_device": "offload_optimizer_device",
    "offload_param_device": "offload_param_device",
    "offload_optimizer_nvme_path": "offload_optimizer_nvme_path",
    "offload_param_nvme_path": "offload_param_nvme_path",
    "zero3_init_flag": "zero3_init_flag",
    "zero3_save_16bit_model": "zero3_save_16bit_model",
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "transformer_moe_cls_names": "deepspeed_moe_layer_cls_names",
}
_DEEPSPEED_OWN = {
    "hf_ds_config": (
        lambda v, p: v is None or _is_field_template(v),
        "DeepSpeed JSON configs are not read; set zero_stage and the offload devices instead",
    ),
    "enable_msamp": (
        lambda v, p: not v,
        "use mixed_precision='fp8' with FP8RecipeKwargs(backend='MSAMP')",
    ),
    # Meaningful only with enable_msamp (refused above) or DeepSpeed's batch arithmetic.
    "msamp_opt_level": (lambda v, p: True, ""),
    "is_train_batch_min": (lambda v, p: True, ""),
}
# What Accelerate's DeepSpeedPlugin writes into hf_ds_config from its own fields.
_DS_TEMPLATE_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "gradient_clipping",
    "steps_per_print",
}
_DS_ZERO_KEYS = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "stage3_gather_16bit_weights_on_model_save",
}


def _is_field_template(config: Any) -> bool:
    """Whether a DeepSpeed config holds only what DeepSpeedPlugin derives from its fields."""
    data = getattr(config, "config", config)
    if not isinstance(data, Mapping) or set(data) - _DS_TEMPLATE_KEYS:
        return False
    zero = data.get("zero_optimization", {})
    batches = [data.get(k, "auto") for k in ("train_batch_size", "train_micro_batch_size_per_gpu")]
    return isinstance(zero, Mapping) and not set(zero) - _DS_ZERO_KEYS and batches == ["auto"] * 2


def _plugin_fields(plugin: Any, what: str) -> dict[str, Any]:
    if isinstance(plugin, Mapping):
        return dict(plugin)
    if dataclasses.is_dataclass(plugin):
        return {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)}
    raise TypeError(
        f"{what} takes Accelerate's plugin object or a dict of its fields, got "
        f"{type(plugin).__name__}"
    )


def _plain(value: Any) -> Any:
    """A plugin field value (torch enums, offload policies, wrap functions) as config words."""
    if isinstance(value, enum.Enum):
        return value.name
    if type(value).__name__ == "CPUOffload":  # FSDP1's
        return bool(value.offload_params)
    if type(value).__name__ in ("OffloadPolicy", "CPUOffloadPolicy"):  # FSDP2's
        return type(value).__name__ == "CPUOffloadPolicy"
    if isinstance(value, functools.partial):
        value = value.func
    if callable(value) and getattr(value, "__name__", None) in _WRAP_POLICIES:
        return _WRAP_POLICIES[value.__name__]
    if callable(value):
        return value  # refused by its key's handler with the key named
    if isinstance(value, (list, tuple, set)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    return value


def _plugin_section(
    plugin: Any, what: str, table: Mapping[str, str], own: Mapping[str, Any], prefix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """(config section, {config key path: plugin field}) for a plugin; refuses what cannot map."""
    given = _plugin_fields(plugin, what)
    section: dict[str, Any] = {}
    renames: dict[str, str] = {}
    for name, value in given.items():
        if name in own:
            accepted, why = own[name]
            if not accepted(value, given):
                raise TargetError(f"{what}.{name}={value!r} cannot be honoured: {why}", part=what)
            continue
        # A dict may also use the config file's own key names.
        key = table.get(name, name if name in table.values() else None)
        if key is None:
            raise TargetError(
                f"{what}.{name}: unknown field; {what} takes {', '.join([*table, *own])}",
                part=what,
            )
        value = _plain(value)
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            continue  # unset, or "auto": filled from the Accelerator's own arguments
        section[key] = value
        renames[f"{prefix}{key}"] = f"{what}.{name}"
    return section, renames


def _read(data: dict[str, Any], renames: Mapping[str, str]) -> Target:
    """An Accelerate config mapping read as a config file is (messages name the argument)."""
    try:
        return read_target_sections(data, "Accelerator")
    except TargetError as err:
        message = str(err)
        for key in sorted(renames, key=len, reverse=True):
            message = message.replace(key, renames[key])
        raise TargetError(message, part=err.part) from None


def _plugin_target(fsdp_plugin: Any, deepspeed_plugin: Any) -> tuple[Target, int | None]:
    if fsdp_plugin is not None:
        section, renames = _plugin_section(
            fsdp_plugin, "fsdp_plugin", _FSDP_FIELDS, _FSDP_OWN, "fsdp_config."
        )
        return _read({"distributed_type": "FSDP", "fsdp_config": section}, renames), None
    section, renames = _plugin_section(
        deepspeed_plugin, "deepspeed_plugin", _DEEPSPEED_FIELDS, _DEEPSPEED_OWN, "deepspeed_config."
    )
    steps = section.pop("gradient_accumulation_steps", None)
    if section.get("zero_stage") is None:
        raise TargetError(
            "deepspeed_plugin.zero_stage is not set: give 0, 1, 2 or 3", "deepspeed_plugin"
        )
    target = _read({"distributed_type": "DEEPSPEED", "deepspeed_config": section}, renames)
    return target, None if steps is None else int(steps)


# ------------------------------------------------------------------------------ resolution


def _with_tp(base: Target, origin: str, tp_plugin: Any) -> tuple[Target, str]:
    """TorchTensorParallelPlugin(tp_size=N): tp[size=N] alone or beside the plugin's fsdp."""
    if tp_plugin is None:
        return base, origin
    size = getattr(tp_plugin, "tp_size", None)
    if origin not in ("fsdp_plugin",) and not origin.startswith("default"):
        raise TargetError(
            f"torch_tp_plugin with {origin}: give the layout in one place (tp[size={size}] in "
            "the target, or the plugin with fsdp_plugin or alone)",
            "torch_tp_plugin",
        )
    sizes = {"tp_size": size, "dp_shard_size": 2 if origin == "fsdp_plugin" else 1}
    tp = parallelism_target(sizes, "torch_tp_plugin").get("tp")
    parts = {p.name: dict(p.options) for p in base.parts if p.name not in ("single", "ddp")}
    return Target.from_dict({**parts, "tp": dict(tp.options)}), f"{origin} + torch_tp_plugin"


def _base(
    target: Any,
    fsdp_plugin: Any,
    deepspeed_plugin: Any,
    world_size: int,
    parallelism_config: Any = None,
) -> tuple[Target, str, int | None]:
    chosen = [
        n
        for n, v in (
            ("target=", target),
            ("fsdp_plugin", fsdp_plugin),
            ("deepspeed_plugin", deepspeed_plugin),
            ("parallelism_config", parallelism_config),
        )
        if v is not None
    ]
    if len(chosen) > 1:
        raise TargetError(
            f"{' and '.join(chosen)} both choose the distribution: pass one of them", chosen[0]
        )
    if target is not None:
        return parse_target(target), "target=", None
    if parallelism_config is not None:
        sizes = {k: getattr(parallelism_config, k, None) for k in (*SIZES, *CONTEXT_SIZES)}
        handler = getattr(parallelism_config, "cp_handler", None)
        sizes["cp_comm_strategy"] = getattr(handler, "cp_comm_strategy", None)
        return parallelism_target(sizes, "parallelism_config"), "parallelism_config", None
    if chosen:
        plugin_target, steps = _plugin_target(fsdp_plugin, deepspeed_plugin)
        return plugin_target, chosen[0], steps
    launched = launched_target()
    if launched is not None:
        return launched, f"${TARGET_ENV}", None
    pjrt = os.environ.get("PJRT_DEVICE")
    if world_size == 1 and pjrt and xla.available():  # as Accelerate picks XLA under torch_xla
        return Target.parse("xla"), f"default under PJRT_DEVICE={pjrt} (torch_xla)", None
    many = world_size > 1
    return (
        Target.parse("ddp" if many else "single"),
        f"default for {world_size} process{'es' if many else ''}",
        None,
    )


def _precision(
    base: Target, origin: str, mixed_precision: str | None, recipe: KwargsHandler | None
) -> dict[str, dict[str, Any]]:
    """The precision parts: the base's, or those mixed_precision= names, plus recipe options."""
    parts = {p.name: dict(p.options) for p in base.parts if p.name in PRECISION_PART_NAMES}
    if mixed_precision is not None:
        word = str(getattr(mixed_precision, "value", mixed_precision)).strip().lower()
        if word not in PRECISION_PARTS:
            raise TargetError(
                f"mixed_precision={mixed_precision!r}: use one of {', '.join(PRECISION_PARTS)}",
                "mixed_precision",
            )
        stated = precision_of(base)
        if word != (stated or "no"):
            if origin == "target=" and stated is not None:
                raise TargetError(
                    f"target='{base}' says {stated} but mixed_precision={word!r}: keep one",
                    "mixed_precision",
                )
            parts = {name: {} for name in PRECISION_PARTS[word]}
    if recipe is None:
        return parts
    if "fp8" not in parts:
        raise KwargsHandlerError(
            f"{type(recipe).__name__} configures fp8, but the target has no 'fp8' part: pass "
            "mixed_precision='fp8'"
        )
    if parts["fp8"]:
        raise KwargsHandlerError(
            f"{type(recipe).__name__} and the target's fp8[...] options both configure fp8: "
            "keep one of them"
        )
    config = recipe.fp8_config()
    cls = type(recipe).__name__
    renames = {f"fp8_config.{key}": f"{cls}.{key}" for key in config}
    read = _read(
        {"distributed_type": "NO", "mixed_precision": "fp8", "fp8_config": config}, renames
    )
    parts["fp8"] = dict(read.get("fp8").options)
    return parts


def resolve_target(
    *,
    target: Any = None,
    mixed_precision: str | None = None,
    fsdp_plugin: Any = None,
    deepspeed_plugin: Any = None,
    handlers: Mapping[type, KwargsHandler] | None = None,
    world_size: int = 1,
    parallelism_config: Any = None,
    torch_tp_plugin: Any = None,
) -> Resolution:
    """The target an Accelerator with these arguments trains for (see the module docstring)."""
    handlers = dict(handlers or {})
    base, origin, steps = _base(
        target, fsdp_plugin, deepspeed_plugin, world_size, parallelism_config
    )
    base, origin = _with_tp(base, origin, torch_tp_plugin)
    recipe = next((h for cls, h in handlers.items() if issubclass(cls, FP8_RECIPES)), None)
    precision = _precision(base, origin, mixed_precision, recipe)
    parts = {p.name: dict(p.options) for p in base.parts if p.name not in PRECISION_PART_NAMES}
    if precision and list(parts) == ["single"]:
        parts = {}  # "bf16" alone is single-process bf16; "single+bf16" says it twice
    draft = TargetDraft(parts={**parts, **precision}, strategy_is_default=origin.startswith("def"))
    for handler in handlers.values():
        handler.shape_target(draft)
    try:
        resolved = Target.from_dict(draft.parts)
    except TargetError as err:
        raise TargetError(
            f"the Accelerator's arguments give a target that cannot run: {err}", err.part
        ) from None
    return Resolution(target=resolved, origin=origin, gradient_accumulation_steps=steps)
