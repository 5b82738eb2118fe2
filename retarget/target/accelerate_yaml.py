"""Accelerate config files (what ``accelerate config`` writes) read into an AccelerateConfig.

Existing configs keep working, and nothing in them is dropped silently: every key is mapped to
the target or to the launch settings, ignored because its value is a no-op (false, empty,
``main``, ...), or refused with the reason. Unknown keys are errors, as in Accelerate.

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
    dynamo_config     dynamo_backend NO -> nothing, else compile[backend=<lowercase>];
                      dynamo_mode, dynamo_use_fullgraph, dynamo_use_dynamic,
                      dynamo_use_regional_compilation

We always make each repeated block its own FSDP unit (found structurally, so
fsdp_transformer_layer_cls_to_wrap is not needed) and always run FSDP2, which keeps the original
parameters and prefetches the next unit's all-gather. So fsdp_auto_wrap_policy
TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP, fsdp_transformer_layer_cls_to_wrap, fsdp_version 1
or 2, fsdp_use_orig_params, fsdp_forward_prefetch and fsdp_backward_prefetch BACKWARD_PRE are
accepted: they describe what we do anyway. NO_WRAP and other prefetch policies are refused.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

from retarget.target.grammar import PARTS, Target, TargetError

__all__ = ["AccelerateConfig", "read_accelerate_config"]


@dataclass(frozen=True)
class AccelerateConfig:
    """What an Accelerate config file says: the target and how to launch it."""

    target: Target
    """The training target that distributed_type, mixed_precision, ... map to."""
    num_processes: int | None
    """Processes over all machines; None when the file leaves it to the launcher."""
    num_machines: int
    """Number of machines (nodes)."""
    machine_rank: int
    """This machine's rank, 0 <= machine_rank < num_machines."""
    main_process_ip: str | None
    """Address of the rank-0 machine (multi-node)."""
    main_process_port: int | None
    """Port of the rank-0 machine (multi-node)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""
    use_cpu: bool
    """Run on the CPU even when an accelerator is present."""
    source: str
    """Path of the file read."""
    gpu_ids: str | None = None
    """Devices to use on this machine, e.g. "0,1" or "all"; None: all."""
    rdzv_backend: str = "static"
    """torchrun rendezvous backend."""


@dataclass(frozen=True)
class _File:
    data: Mapping[str, Any]
    source: str

    def fail(self, key: str, problem: str) -> NoReturn:
        raise TargetError(f"{self.source}: {key}: {problem}", part=key)


Parts = dict[str, dict[str, Any]]
# A handler reads one key: (file, key path, value, parts being built, the part it belongs to).
Handler = Callable[[_File, str, Any, Parts, str], None]
Convert = Callable[[_File, str, Any], Any]
_NOOPS = (None, False, "", "no", "none", [], {})


def _is_noop(value: Any, extra: tuple[Any, ...] = ()) -> bool:
    if isinstance(value, str):
        value = value.strip().lower()
        extra = tuple(e.lower() if isinstance(e, str) else e for e in extra)
    if isinstance(value, (dict, list)) and value:
        items = value.values() if isinstance(value, dict) else value
        return all(_is_noop(item) for item in items)
    return any(value == noop and type(value) is type(noop) for noop in (*_NOOPS, *extra))


def _as_bool(file: _File, key: str, value: Any) -> bool:
    words = {"true": True, "yes": True, "false": False, "no": False}
    if isinstance(value, str) and value.strip().lower() in words:
        return words[value.strip().lower()]
    if not isinstance(value, bool):
        file.fail(key, f"expected true or false, got {value!r}")
    return value


def _as_int(file: _File, key: str, value: Any, low: int = 0) -> int:
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip(), re.ASCII):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        file.fail(key, f"expected an integer, got {value!r}")
    if value < low:
        file.fail(key, f"must be >= {low}, got {value}")
    return value


def _as_text(file: _File, key: str, value: Any) -> str | None:
    if value is None or isinstance(value, (str, int)) and not isinstance(value, bool):
        return None if value is None else str(value).strip()
    return file.fail(key, f"expected a string, got {value!r}")


def _word(value: Any) -> str:
    # Unquoted NO is YAML 1.1's false: `distributed_type: NO` means the word.
    return "NO" if value is False else str(value).strip().upper()


def _words(table: Mapping[str, Any]) -> Convert:
    """A converter from the words of ``table`` (case-insensitive; ints read as their digits)."""

    def convert(file: _File, key: str, value: Any) -> Any:
        word = _word(value)
        if word not in table:
            close = difflib.get_close_matches(word, list(table), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            file.fail(key, f"{value!r} is not one of {', '.join(table)}{hint}")
        return table[word]

    return convert


def _skip(file: _File, key: str, value: Any, parts: Parts, home: str) -> None:
    """The key is read by the function that owns its section."""


def _sets(option: str, convert: Convert) -> Handler:
    """The key sets ``option`` of the part it belongs to."""

    def handle(file: _File, key: str, value: Any, parts: Parts, home: str) -> None:
        value = convert(file, key, value)
        spec = PARTS[home].options.get(option)
        if spec is None:
            default = next(p.options[option].default for p in PARTS.values() if option in p.options)
            if value != default:
                file.fail(key, f"{value!r} has no meaning for '{home}'; remove it")
            return
        try:
            parts[home][option] = spec.coerce(value)
        except ValueError as err:
            file.fail(key, f"bad value {value!r}: {err}")

    return handle


def _adds(part: str) -> Handler:
    """The key is a bool that adds ``part`` to the target."""

    def handle(file: _File, key: str, value: Any, parts: Parts, home: str) -> None:
        if _as_bool(file, key, value):
            parts.setdefault(part, {})

    return handle


def _accepts(convert: Convert) -> Handler:
    """The key is accepted with any valid value: it describes what we do anyway."""

    def handle(file: _File, key: str, value: Any, parts: Parts, home: str) -> None:
        convert(file, key, value)

    return handle


def _only(*values: Any, why: str) -> Handler:
    """The key is accepted only with a no-op value (or one of ``values``); else refused."""

    def handle(file: _File, key: str, value: Any, parts: Parts, home: str) -> None:
        if not _is_noop(value, values):
            file.fail(key, f"{value!r} cannot be honoured: {why}")

    return handle


def _apply(file: _File, section: str, config: Mapping, keys: Mapping, parts: Parts, home: str):
    for key in config:
        if key not in keys:
            close = difflib.get_close_matches(str(key), list(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            file.fail(f"{section}{key}", f"unknown key{hint}")
    for key, value in config.items():
        keys[key](file, f"{section}{key}", value, parts, home)


def _section(file: _File, key: str) -> Mapping[str, Any]:
    value = file.data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        file.fail(key, f"expected a mapping, got {value!r}")
    return value


_BACKWARD_PREFETCH = _only("BACKWARD_PRE", why="FSDP2 prefetches in backward like BACKWARD_PRE")
_FSDP_KEYS: dict[str, Handler] = {
    "fsdp_sharding_strategy": _skip,
    "fsdp_reshard_after_forward": _skip,
    "fsdp_offload_params": _adds("offload"),
    "fsdp_activation_checkpointing": _adds("ac"),
    "fsdp_state_dict_type": _sets(
        "state_dict", _words({"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"})
    ),
    "fsdp_cpu_ram_efficient_loading": _sets("cpu_ram_efficient_loading", _as_bool),
    "fsdp_sync_module_states": _sets("sync_module_states", _as_bool),
    "fsdp_min_num_params": _sets("min_params", _as_int),
    "fsdp_version": _only(1, 2, why="FSDP versions are 1 and 2 (both run as FSDP2 here)"),
    "fsdp_auto_wrap_policy": _only(
        "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", why="each repeated block is its own unit"
    ),
    "fsdp_transformer_layer_cls_to_wrap": _accepts(_as_text),
    "fsdp_backward_prefetch": _BACKWARD_PREFETCH,
    "fsdp_backward_prefetch_policy": _BACKWARD_PREFETCH,
    "fsdp_forward_prefetch": _accepts(_as_bool),
    "fsdp_use_orig_params": _accepts(_as_bool),
    "fsdp_activation_cpu_offload": _only(why="activation offloading is not supported"),
}
# Sharding strategies as target parts.
_SHARDING = {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp"}
_SHARDING.update({"HYBRID_SHARD": "hsdp", "HYBRID_SHARD_ZERO2": "hsdp[reshard=false]"})
_SHARDING.update({str(i): _SHARDING[name] for i, name in enumerate(_SHARDING, start=1)})


def _sharding(file: _File, key: str, value: Any) -> str:
    if key.endswith("reshard_after_forward") and str(value).upper() in ("TRUE", "FALSE"):
        return "fsdp" if _as_bool(file, key, value) else "zero2"
    return _words(_SHARDING)(file, key, value)


def _read_fsdp(file: _File, parts: Parts) -> None:
    config = _section(file, "fsdp_config")
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
    _apply(file, "fsdp_config.", config, _FSDP_KEYS, parts, strategy.name)


_HOSTS = "hostfiles are for DeepSpeed's own launchers; retarget launches with torchrun"
_DEEPSPEED_KEYS: dict[str, Handler] = {
    **dict.fromkeys(("zero_stage", "gradient_accumulation_steps"), _skip),
    **dict.fromkeys(("offload_optimizer_device", "offload_param_device"), _skip),
    # Paths are used only with nvme offload, which is refused.
    **dict.fromkeys(("offload_optimizer_nvme_path", "offload_param_nvme_path"), _accepts(_as_text)),
    "gradient_clipping": _only(why="clip in the training loop with clip_grad_norm_"),
    "zero3_init_flag": _only(why="use zero3[cpu_ram_efficient_loading=true] instead"),
    "zero3_save_16bit_model": _only(why="use zero3[state_dict=full] to save full weights"),
    "deepspeed_config_file": _only(why="DeepSpeed JSON files are not read; set zero_stage here"),
    "deepspeed_multinode_launcher": _only("standard", why="retarget launches with torchrun"),
    **dict.fromkeys(
        ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"),
        _only(why=_HOSTS),
    ),
    "deepspeed_moe_layer_cls_names": _only(why="DeepSpeed MoE layers are not supported"),
}
_ZERO_STAGES = {"0": "ddp", "1": "zero1", "2": "zero2", "3": "zero3"}


def _offload_device(file: _File, key: str, value: Any) -> bool:
    if str(value).strip().upper() == "NVME":
        file.fail(key, "nvme offload cannot be honoured; use cpu or none")
    return _words({"NONE": False, "CPU": True})(file, key, "none" if value is None else value)


def _read_deepspeed(file: _File, parts: Parts) -> None:
    config = _section(file, "deepspeed_config")
    if config.get("zero_stage") is None:
        file.fail("deepspeed_config.zero_stage", "missing; set 0, 1, 2 or 3")
    strategy = _words(_ZERO_STAGES)(file, "deepspeed_config.zero_stage", config["zero_stage"])
    parts[strategy] = {}
    _apply(file, "deepspeed_config.", config, _DEEPSPEED_KEYS, parts, strategy)
    offload = {
        option: _offload_device(file, f"deepspeed_config.{key}", config.get(key))
        for option, key in (
            ("optimizer", "offload_optimizer_device"),
            ("params", "offload_param_device"),
        )
    }
    if any(offload.values()):
        parts["offload"] = offload


def _read_tp(file: _File, parts: Parts) -> None:
    config = _section(file, "tp_config")
    _apply(file, "tp_config.", config, {"tp_size": _skip}, parts, "tp")
    parts["tp"] = {"size": _as_int(file, "tp_config.tp_size", config.get("tp_size", 0))}


def _plain(name: str) -> Callable[[_File, Parts], None]:
    def read(file: _File, parts: Parts) -> None:
        parts[name] = {}

    return read


_DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA")
_DISTRIBUTED: dict[str, Callable[[_File, Parts], None]] = {
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


def _read_distribution(file: _File, parts: Parts) -> str:
    value = file.data.get("distributed_type")
    if value is None:
        file.fail("distributed_type", f"missing; set one of {', '.join(_DISTRIBUTED)}")
    kind = _word(value)
    if kind == "MEGATRON_LM":
        file.fail(
            "distributed_type",
            "MEGATRON_LM cannot be honoured (no pass implements tensor parallelism yet); "
            "to split a model too large for one process, use FSDP",
        )
    _words(dict.fromkeys(_DISTRIBUTED))(file, "distributed_type", value)
    for section, owner in _SECTION_OWNER.items():
        if owner != kind and not _is_noop(file.data.get(section)):
            file.fail(section, f"is set but distributed_type is {kind}; remove it, or use {owner}")
    _DISTRIBUTED[kind](file, parts)
    return kind


_FP8_FORMAT = _words({"HYBRID": "hybrid", "E4M3": "e4m3"})
_AMAX_ALGO = _words({"MAX": "max", "MOST_RECENT": "most_recent"})
_OPT_LEVEL = _words({"O1": "o1", "O2": "o2"})


def _three_bools(file: _File, key: str, value: Any) -> tuple[bool, ...]:
    if value is False:  # what `accelerate config` writes when nothing is overridden
        return (False, False, False)
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        file.fail(key, f"expected [fprop, dgrad, wgrad] bools, got {value!r}")
    return tuple(_as_bool(file, key, item) for item in value)


_FP8_BACKENDS = {"TE": "te", "MSAMP": "msamp", "MS-AMP": "msamp", "AO": "torchao"}
_FP8_KEYS: dict[str, Handler] = {
    "backend": _sets("backend", _words(_FP8_BACKENDS)),
    "fp8_format": _sets("format", _FP8_FORMAT),
    "amax_history_len": _sets("amax_history", _as_int),
    "amax_history_length": _sets("amax_history", _as_int),
    "amax_compute_algo": _sets("amax_algo", _AMAX_ALGO),
    "amax_compute_algorithm": _sets("amax_algo", _AMAX_ALGO),
    "margin": _sets("margin", _as_int),
    "interval": _sets("interval", _as_int),
    "override_linear_precision": _sets("override_linear_precision", _three_bools),
    "use_autocast_during_eval": _sets("autocast_eval", _as_bool),
    "opt_level": _sets("opt_level", _OPT_LEVEL),
    "optimization_level": _sets("opt_level", _OPT_LEVEL),
}
# Accelerate's recipe defaults that differ from fp8's: kept so a config means what it meant.
_FP8_BACKEND_DEFAULTS = {"te": {"amax_history": 1024}, "torchao": {"scaling": "current"}}
_MIXED = {"NO": (), "BF16": ("bf16",), "FP16": ("fp16",), "FP8": ("bf16", "fp8")}


def _read_precision(file: _File, parts: Parts) -> None:
    mixed = file.data.get("mixed_precision")
    if mixed is None:  # the old format wrote `fp16: true`
        mixed = "fp16" if _as_bool(file, "fp16", file.data.get("fp16", False)) else "no"
    names = _words(_MIXED)(file, "mixed_precision", mixed)
    parts.update({name: {} for name in names})
    fp8 = _section(file, "fp8_config")
    if "fp8" not in names and not _is_noop(fp8):
        file.fail("fp8_config", f"is set but mixed_precision is {mixed}; remove it, or use fp8")
    if "fp8" in names:
        _apply(file, "fp8_config.", fp8, _FP8_KEYS, parts, "fp8")
        backend = parts["fp8"].get("backend", "auto")
        parts["fp8"] = {**_FP8_BACKEND_DEFAULTS.get(backend, {}), **parts["fp8"]}
    if _as_bool(file, "downcast_bf16", file.data.get("downcast_bf16", False)):
        if names != ("bf16",):
            file.fail("downcast_bf16", "applies only with mixed_precision: bf16")
        parts["bf16"]["downcast"] = True


_DYNAMO_KEYS: dict[str, Handler] = {
    "dynamo_backend": _skip,
    "dynamo_mode": _sets("mode", lambda file, key, value: value),
    "dynamo_use_fullgraph": _sets("fullgraph", _as_bool),
    "dynamo_use_dynamic": _sets("dynamic", _as_bool),
    "dynamo_use_regional_compilation": _sets("regional", _as_bool),
}


def _read_dynamo(file: _File, parts: Parts) -> None:
    config = _section(file, "dynamo_config")
    old = file.data.get("dynamo_backend")  # the old format's top-level key
    if old is not None and config.get("dynamo_backend") not in (None, old):
        file.fail("dynamo_backend", "differs from dynamo_config.dynamo_backend; keep one")
    backend = config.get("dynamo_backend", old)
    if _is_noop(backend):
        _apply(file, "dynamo_config.", config, _DYNAMO_KEYS, {"compile": {}}, "compile")
        for key, value in config.items():
            if not _is_noop(value, ("default",)):
                file.fail(f"dynamo_config.{key}", "is set but dynamo_backend is NO; remove it")
        return
    parts["compile"] = {"dynamic": False}  # Accelerate's default when dynamo_use_dynamic is absent
    _sets("backend", _as_text)(file, "dynamo_config.dynamo_backend", backend, parts, "compile")
    _apply(file, "dynamo_config.", config, _DYNAMO_KEYS, parts, "compile")


_TPU = "launching on TPU pods is not supported"
# Every top-level key: read by a _read_* function (_skip), kept, or accepted only as a no-op.
_TOP_KEYS: dict[str, Handler] = {
    **dict.fromkeys(
        ("compute_environment", "distributed_type", "mixed_precision", "fp16", "downcast_bf16")
        + ("fsdp_config", "deepspeed_config", "tp_config", "fp8_config", "dynamo_config")
        + ("dynamo_backend", "num_processes", "num_machines", "machine_rank", "use_cpu")
        + ("main_process_ip", "main_process_port", "gradient_accumulation_steps", "gpu_ids")
        + ("rdzv_backend",),
        _skip,
    ),
    "same_network": _accepts(_as_bool),  # only decides whether Accelerate asks for rdzv_backend
    "debug": _only(why="distributed debug checks (ACCELERATE_DEBUG_MODE) are not implemented"),
    "enable_cpu_affinity": _only(why="NUMA CPU affinity is not implemented"),
    "main_training_function": _only("main", why="retarget runs the script, not a function"),
    **dict.fromkeys(("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo"), _only(why=_TPU)),
    **dict.fromkeys(("tpu_vm", "tpu_env", "commands", "command_file"), _only(why=_TPU)),
    "megatron_lm_config": _only(why="Megatron-LM is not supported"),
    "ipex_config": _only(why="Intel Extension for PyTorch is not supported"),
    "mpirun_config": _only(why="retarget launches with torchrun, not mpirun"),
    "parallelism_config": _only(why="write the target instead, e.g. hsdp"),
}
_ENVIRONMENTS = {"LOCAL_MACHINE": False, "AMAZON_SAGEMAKER": True}


def _gradient_accumulation(file: _File) -> int:
    key = "gradient_accumulation_steps"
    top, deepspeed = file.data.get(key), _section(file, "deepspeed_config").get(key)
    if None not in (top, deepspeed) and top != deepspeed:
        file.fail(key, f"{top!r} differs from deepspeed_config.{key} {deepspeed!r}; keep one")
    if top is None and deepspeed is not None:
        return _as_int(file, f"deepspeed_config.{key}", deepspeed, low=1)
    return _as_int(file, key, 1 if top is None else top, low=1)


def _launch(file: _File, kind: str) -> dict[str, Any]:
    data = file.data
    machines = _as_int(file, "num_machines", data.get("num_machines", 1), low=1)
    rank = _as_int(file, "machine_rank", data.get("machine_rank", 0))
    if rank >= machines:
        file.fail("machine_rank", f"must be below num_machines ({machines}), got {rank}")
    processes = data.get("num_processes")
    processes = None if processes in (None, -1) else _as_int(file, "num_processes", processes, 1)
    if kind == "NO" and processes not in (None, 1):
        file.fail("num_processes", f"distributed_type NO runs one process, got {processes}")
    port = data.get("main_process_port")
    if port is not None and not 0 < _as_int(file, "main_process_port", port) < 65536:
        file.fail("main_process_port", f"must be a port number in 1..65535, got {port}")
    return {
        "num_processes": 1 if kind == "NO" else processes,
        "num_machines": machines,
        "machine_rank": rank,
        "main_process_ip": _as_text(file, "main_process_ip", data.get("main_process_ip")),
        "main_process_port": None if port is None else int(port),
        "gradient_accumulation_steps": _gradient_accumulation(file),
        "use_cpu": _as_bool(file, "use_cpu", data.get("use_cpu", False)),
        "gpu_ids": _as_text(file, "gpu_ids", data.get("gpu_ids")),
        "rdzv_backend": _as_text(file, "rdzv_backend", data.get("rdzv_backend")) or "static",
    }


def _load(source: str) -> Mapping[str, Any]:
    with open(source, encoding="utf-8") as stream:
        try:
            data = yaml.safe_load(stream)
        except yaml.YAMLError as err:
            raise TargetError(f"{source}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise TargetError(f"{source}: expected a mapping of Accelerate config keys, got {kind}")
    return data


def read_accelerate_config(path: str | os.PathLike[str]) -> AccelerateConfig:
    """Read an ``accelerate config`` YAML file; raises TargetError for what cannot be honoured.

    ``read_accelerate_config("fsdp.yaml").target`` -> ``Target('fsdp+bf16+ac')``.
    """
    source = os.fspath(path)
    file = _File(_load(source), source)
    parts: Parts = {}
    _apply(file, "", file.data, _TOP_KEYS, parts, "single")
    environment = file.data.get("compute_environment", "LOCAL_MACHINE")
    if _words(_ENVIRONMENTS)(file, "compute_environment", environment):
        file.fail("compute_environment", f"{environment} cannot be honoured: run on the machine")
    kind = _read_distribution(file, parts)
    _read_precision(file, parts)
    _read_dynamo(file, parts)
    try:
        target = Target.from_dict(parts)
    except TargetError as err:
        raise TargetError(f"{source}: {err}", part=err.part) from None
    return AccelerateConfig(target=target, source=source, **_launch(file, kind))
