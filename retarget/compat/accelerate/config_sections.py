"""The sections of an Accelerate config that say the target, each a table of key handlers.

    distributed_type  NO -> single; MULTI_GPU, MULTI_CPU, MULTI_XPU, MULTI_NPU, MULTI_MLU,
                      MULTI_MUSA, MULTI_HPU -> ddp; FSDP -> from fsdp_config; DEEPSPEED ->
                      deepspeed_config.zero_stage 0/1/2/3 -> ddp/zero1/zero2/zero3;
                      XLA or TPU -> xla; TP -> tp[size=tp_config.tp_size]; MEGATRON_LM refused
    fsdp_config       fsdp_sharding_strategy FULL_SHARD|1 -> fsdp, SHARD_GRAD_OP|2 -> zero2,
                      NO_SHARD|3 -> ddp, HYBRID_SHARD|4 -> hsdp, HYBRID_SHARD_ZERO2|5 ->
                      hsdp[reshard=false];
                      fsdp_reshard_after_forward (FSDP2) true -> fsdp, false -> zero2;
                      fsdp_offload_params -> +offload; fsdp_activation_checkpointing -> +ac;
                      fsdp_state_dict_type, fsdp_cpu_ram_efficient_loading,
                      fsdp_sync_module_states, fsdp_min_num_params -> the strategy's options
    deepspeed_config  offload_optimizer_device / offload_param_device cpu -> +offload
    mixed_precision   bf16 -> bf16; fp16 -> fp16; fp8 -> bf16+fp8 (Accelerate runs the non-fp8
                      ops in bf16); downcast_bf16 -> bf16[downcast=true] (XLA only)
    fp8_config        backend TE|MSAMP|AO -> fp8[backend=te|msamp|torchao] with Accelerate's
                      defaults for it (te: amax_history=1024; torchao: scaling=current);
                      fp8_format, amax_history_len, amax_compute_algo, margin, interval,
                      override_linear_precision, use_autocast_during_eval, opt_level
    parallelism_config  (with FSDP only) parallelism_config_{dp_replicate,dp_shard,tp}_size ->
                      the layout of targets/parallelism.py in place of fsdp_config's strategy,
                      keeping its options: dp_shard 2 + tp 2 -> fsdp+tp[size=2]; cp/sp > 1 and
                      the other cp_*/sp_* keys refused
    dynamo_config     dynamo_backend NO -> nothing, else compile[backend=<lowercase>];
                      dynamo_mode, dynamo_use_fullgraph, dynamo_use_dynamic,
                      dynamo_use_regional_compilation true -> scope=regions, false ->
                      scope=whole; absent -> scope=regions (Accelerate would compile the whole
                      model: the same numbers, and compile time independent of depth)

We always make each repeated block its own FSDP unit (found structurally, so
fsdp_transformer_layer_cls_to_wrap is not needed) and always run FSDP2, which keeps the original
parameters and prefetches the next unit's all-gather. So fsdp_auto_wrap_policy
TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP, fsdp_transformer_layer_cls_to_wrap, fsdp_version 1
or 2, fsdp_use_orig_params, fsdp_forward_prefetch and fsdp_backward_prefetch BACKWARD_PRE are
accepted: they describe what we do anyway. NO_WRAP and other prefetch policies are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from retarget.compat.accelerate.config_keys import (
    AccelerateFile,
    Handler,
    Parts,
    accepted,
    adds_part,
    apply_keys,
    as_bool,
    as_int,
    as_text,
    is_noop,
    read_elsewhere,
    read_section,
    refused_unless,
    sets_option,
    upper_word,
    word_map,
)
from retarget.targets.errors import TargetError
from retarget.targets.grammar import Target
from retarget.targets.parallelism import CONTEXT_SIZES, SIZES, parallelism_target, with_layout

__all__ = ["read_distribution", "read_dynamo", "read_precision", "read_target_sections"]


_BACKWARD_PREFETCH = refused_unless(
    "BACKWARD_PRE", why="FSDP2 prefetches in backward like BACKWARD_PRE"
)
_FSDP_KEYS: dict[str, Handler] = {
    "fsdp_sharding_strategy": read_elsewhere,
    "fsdp_reshard_after_forward": read_elsewhere,
    "fsdp_offload_params": adds_part("offload"),
    "fsdp_activation_checkpointing": adds_part("ac"),
    "fsdp_state_dict_type": sets_option(
        "state_dict", word_map({"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"})
    ),
    "fsdp_cpu_ram_efficient_loading": sets_option("cpu_ram_efficient_loading", as_bool),
    "fsdp_sync_module_states": sets_option("sync_module_states", as_bool),
    "fsdp_min_num_params": sets_option("min_params", as_int),
    "fsdp_version": refused_unless(1, 2, why="FSDP versions are 1 and 2 (both run as FSDP2 here)"),
    "fsdp_auto_wrap_policy": refused_unless(
        "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", why="each repeated block is its own unit"
    ),
    "fsdp_transformer_layer_cls_to_wrap": accepted(as_text),
    "fsdp_backward_prefetch": _BACKWARD_PREFETCH,
    "fsdp_backward_prefetch_policy": _BACKWARD_PREFETCH,
    "fsdp_forward_prefetch": accepted(as_bool),
    "fsdp_use_orig_params": accepted(as_bool),
    "fsdp_activation_cpu_offload": refused_unless(why="activation offloading is not supported"),
}
# Sharding strategies as target parts.
_SHARDING = {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp"}
_SHARDING.update({"HYBRID_SHARD": "hsdp", "HYBRID_SHARD_ZERO2": "hsdp[reshard=false]"})
_SHARDING.update({str(i): _SHARDING[name] for i, name in enumerate(_SHARDING, start=1)})


def _sharding(file: AccelerateFile, key: str, value: Any) -> str:
    if key.endswith("reshard_after_forward") and str(value).upper() in ("TRUE", "FALSE"):
        return "fsdp" if as_bool(file, key, value) else "zero2"
    return word_map(_SHARDING)(file, key, value)


def _read_fsdp(file: AccelerateFile, parts: Parts) -> None:
    config = read_section(file, "fsdp_config")
    chosen = {
        key: _sharding(file, f"fsdp_config.{key}", config[key])
        for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
        if config.get(key) is not None
    }
    if len(set(chosen.values())) > 1:
        meanings = " but ".join(f"{key} means '{spec}'" for key, spec in chosen.items())
        file.fail("fsdp_config", f"{meanings}; keep one of them")
    strategy = Target.parse(next(iter(chosen.values()), "fsdp")).parts[0]
    parts[strategy.name] = dict(strategy.options)
    apply_keys(file, "fsdp_config.", config, _FSDP_KEYS, parts, strategy.name)


_HOSTS = "hostfiles are for DeepSpeed's own launchers; retarget launches with torchrun"
_DEEPSPEED_KEYS: dict[str, Handler] = {
    **dict.fromkeys(("zero_stage", "gradient_accumulation_steps"), read_elsewhere),
    **dict.fromkeys(("offload_optimizer_device", "offload_param_device"), read_elsewhere),
    # Paths are used only with nvme offload, which is refused.
    **dict.fromkeys(("offload_optimizer_nvme_path", "offload_param_nvme_path"), accepted(as_text)),
    "gradient_clipping": refused_unless(why="clip in the training loop with clip_grad_norm_"),
    "zero3_init_flag": refused_unless(why="use zero3[cpu_ram_efficient_loading=true] instead"),
    "zero3_save_16bit_model": refused_unless(why="use zero3[state_dict=full] to save full weights"),
    "deepspeed_config_file": refused_unless(
        why="DeepSpeed JSON files are not read; set zero_stage here"
    ),
    "deepspeed_multinode_launcher": refused_unless(
        "standard", why="retarget launches with torchrun"
    ),
    **dict.fromkeys(
        ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"),
        refused_unless(why=_HOSTS),
    ),
    "deepspeed_moe_layer_cls_names": refused_unless(why="DeepSpeed MoE layers are not supported"),
}
_ZERO_STAGES = {"0": "ddp", "1": "zero1", "2": "zero2", "3": "zero3"}


def _offload_device(file: AccelerateFile, key: str, value: Any) -> bool:
    if str(value).strip().upper() == "NVME":
        file.fail(key, "nvme offload cannot be honoured; use cpu or none")
    return word_map({"NONE": False, "CPU": True})(file, key, "none" if value is None else value)


def _read_deepspeed(file: AccelerateFile, parts: Parts) -> None:
    config = read_section(file, "deepspeed_config")
    if config.get("zero_stage") is None:
        file.fail("deepspeed_config.zero_stage", "missing; set 0, 1, 2 or 3")
    strategy = word_map(_ZERO_STAGES)(file, "deepspeed_config.zero_stage", config["zero_stage"])
    parts[strategy] = {}
    apply_keys(file, "deepspeed_config.", config, _DEEPSPEED_KEYS, parts, strategy)
    offload = {
        option: _offload_device(file, f"deepspeed_config.{key}", config.get(key))
        for option, key in (
            ("optimizer", "offload_optimizer_device"),
            ("params", "offload_param_device"),
        )
    }
    if any(offload.values()):
        parts["offload"] = offload


def _read_tp(file: AccelerateFile, parts: Parts) -> None:
    config = read_section(file, "tp_config")
    apply_keys(file, "tp_config.", config, {"tp_size": read_elsewhere}, parts, "tp")
    parts["tp"] = {"size": as_int(file, "tp_config.tp_size", config.get("tp_size", 0))}


def _plain(name: str) -> Callable[[AccelerateFile, Parts], None]:
    def read(file: AccelerateFile, parts: Parts) -> None:
        parts[name] = {}

    return read


_DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA")
_DISTRIBUTED: dict[str, Callable[[AccelerateFile, Parts], None]] = {
    "NO": _plain("single"),
    **{kind: _plain("ddp") for kind in (*_DDP_TYPES, "MULTI_HPU")},
    "FSDP": _read_fsdp,
    "DEEPSPEED": _read_deepspeed,
    "XLA": _plain("xla"),
    "TPU": _plain("xla"),
    "TP": _read_tp,
}
# Sections that only their distributed_type reads; Accelerate ignores them under other types.
_SECTION_OWNER = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED", "tp_config": "TP"}
# Accelerate reads N-D sizes only with FSDP2 (its launcher refuses them otherwise).
_SECTION_OWNER["parallelism_config"] = "FSDP"


def read_distribution(file: AccelerateFile, parts: Parts) -> str:
    """Add the strategy distributed_type and its section say to ``parts``; returns the type."""
    value = file.data.get("distributed_type")
    if value is None:
        file.fail("distributed_type", f"missing; set one of {', '.join(_DISTRIBUTED)}")
    kind = upper_word(value)
    if kind == "MEGATRON_LM":
        file.fail(
            "distributed_type",
            "MEGATRON_LM cannot be honoured (Megatron-LM's engine is not run here); for "
            "tensor parallelism use TP (tp_config.tp_size), or FSDP to shard",
        )
    word_map(dict.fromkeys(_DISTRIBUTED))(file, "distributed_type", value)
    for section, owner in _SECTION_OWNER.items():
        if owner != kind and not is_noop(file.data.get(section)):
            file.fail(section, f"is set but distributed_type is {kind}; remove it, or use {owner}")
    _DISTRIBUTED[kind](file, parts)
    _read_parallelism(file, parts)
    return kind


_PREFIX = "parallelism_config_"
_ND = "only the dp_replicate/dp_shard/tp/cp/sp sizes of a parallelism config are read"


def _read_parallelism(file: AccelerateFile, parts: Parts) -> None:
    """parallelism_config (Accelerate's N-D sizes, beside FSDP2 only) in place of the strategy
    fsdp_config chose: targets/parallelism.py maps the sizes and merges the two."""
    config = read_section(file, "parallelism_config")
    if is_noop(config):
        return
    sizes: dict[str, Any] = {}
    for key, value in config.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if name in (*SIZES, *CONTEXT_SIZES, "cp_comm_strategy"):
            sizes[name] = value
        elif not is_noop(value):
            file.fail(f"parallelism_config.{key}", f"cannot be honoured: {_ND}")
    try:
        with_layout(parts, parallelism_target(sizes, "parallelism_config"), "parallelism_config")
    except TargetError as error:
        raise TargetError(f"{file.source}: {error}", part="parallelism_config") from None


_FP8_FORMAT = word_map({"HYBRID": "hybrid", "E4M3": "e4m3"})
_AMAX_ALGO = word_map({"MAX": "max", "MOST_RECENT": "most_recent"})
_OPT_LEVEL = word_map({"O1": "o1", "O2": "o2"})


def _three_bools(file: AccelerateFile, key: str, value: Any) -> tuple[bool, ...]:
    if value is False:  # what `accelerate config` writes when nothing is overridden
        return (False, False, False)
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        file.fail(key, f"expected [fprop, dgrad, wgrad] bools, got {value!r}")
    return tuple(as_bool(file, key, item) for item in value)


_FP8_BACKENDS = {"TE": "te", "MSAMP": "msamp", "MS-AMP": "msamp", "AO": "torchao"}
_FP8_KEYS: dict[str, Handler] = {
    "backend": sets_option("backend", word_map(_FP8_BACKENDS)),
    "fp8_format": sets_option("format", _FP8_FORMAT),
    "amax_history_len": sets_option("amax_history", as_int),
    "amax_history_length": sets_option("amax_history", as_int),
    "amax_compute_algo": sets_option("amax_algo", _AMAX_ALGO),
    "amax_compute_algorithm": sets_option("amax_algo", _AMAX_ALGO),
    "margin": sets_option("margin", as_int),
    "interval": sets_option("interval", as_int),
    "override_linear_precision": sets_option("override_linear_precision", _three_bools),
    "use_autocast_during_eval": sets_option("autocast_eval", as_bool),
    "opt_level": sets_option("opt_level", _OPT_LEVEL),
    "optimization_level": sets_option("opt_level", _OPT_LEVEL),
}
# Accelerate's recipe defaults that differ from fp8's: kept so a config means what it meant.
_FP8_BACKEND_DEFAULTS = {"te": {"amax_history": 1024}, "torchao": {"scaling": "current"}}
_MIXED = {"NO": (), "BF16": ("bf16",), "FP16": ("fp16",), "FP8": ("bf16", "fp8")}


def read_precision(file: AccelerateFile, parts: Parts) -> None:
    """Add the precision parts of mixed_precision, fp8_config and downcast_bf16 to ``parts``."""
    mixed = file.data.get("mixed_precision")
    if mixed is None:  # the old format wrote `fp16: true`
        mixed = "fp16" if as_bool(file, "fp16", file.data.get("fp16", False)) else "no"
    names = word_map(_MIXED)(file, "mixed_precision", mixed)
    parts.update({name: {} for name in names})
    fp8 = read_section(file, "fp8_config")
    if "fp8" not in names and not is_noop(fp8):
        file.fail("fp8_config", f"is set but mixed_precision is {mixed}; remove it, or use fp8")
    if "fp8" in names:
        apply_keys(file, "fp8_config.", fp8, _FP8_KEYS, parts, "fp8")
        backend = parts["fp8"].get("backend", "auto")
        parts["fp8"] = {**_FP8_BACKEND_DEFAULTS.get(backend, {}), **parts["fp8"]}
    if as_bool(file, "downcast_bf16", file.data.get("downcast_bf16", False)):
        if names != ("bf16",):
            file.fail("downcast_bf16", "applies only with mixed_precision: bf16")
        parts["bf16"]["downcast"] = True


def _as_scope(file: AccelerateFile, key: str, value: Any) -> str:
    """dynamo_use_regional_compilation: true -> scope=regions, false -> scope=whole."""
    return "regions" if as_bool(file, key, value) else "whole"


_DYNAMO_KEYS: dict[str, Handler] = {
    "dynamo_backend": read_elsewhere,
    "dynamo_mode": sets_option("mode", lambda file, key, value: value),
    "dynamo_use_fullgraph": sets_option("fullgraph", as_bool),
    "dynamo_use_dynamic": sets_option("dynamic", as_bool),
    "dynamo_use_regional_compilation": sets_option("scope", _as_scope),
}


def read_dynamo(file: AccelerateFile, parts: Parts) -> None:
    """Add the compile part dynamo_config (or the old top-level dynamo_backend) asks for."""
    config = read_section(file, "dynamo_config")
    old = file.data.get("dynamo_backend")  # the old format's top-level key
    if old is not None and config.get("dynamo_backend") not in (None, old):
        file.fail("dynamo_backend", "differs from dynamo_config.dynamo_backend; keep one")
    backend = config.get("dynamo_backend", old)
    if is_noop(backend):
        apply_keys(file, "dynamo_config.", config, _DYNAMO_KEYS, {"compile": {}}, "compile")
        for key, value in config.items():
            if not is_noop(value, ("default",)):
                file.fail(f"dynamo_config.{key}", "is set but dynamo_backend is NO; remove it")
        return
    parts["compile"] = {"dynamic": False}  # Accelerate's default when dynamo_use_dynamic is absent
    sets_option("backend", as_text)(file, "dynamo_config.dynamo_backend", backend, parts, "compile")
    apply_keys(file, "dynamo_config.", config, _DYNAMO_KEYS, parts, "compile")


def read_target_sections(data: Mapping[str, Any], source: str) -> Target:
    """The target that the distribution and precision keys of a config mapping describe.

    Only distributed_type with its section and mixed_precision with fp8_config are read, the
    same way as in a file; messages start with ``source``. The Accelerator reads its plugins
    and FP8 recipe handlers through this, written as the config keys they stand for.
    """
    file = AccelerateFile(data, source)
    parts: Parts = {}
    read_distribution(file, parts)
    read_precision(file, parts)
    return Target.from_dict(parts)
