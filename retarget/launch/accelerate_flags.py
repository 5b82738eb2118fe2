"""`retarget launch`'s other Accelerate flags: the target, torchrun's own, the script's env.

    retarget launch --num_processes 2 --use_fsdp --fsdp_offload_params true \\
        --mixed_precision bf16 --gradient_accumulation_steps 2 train.py
    # target fsdp+offload+bf16; the script sees ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2

Distribution and precision flags are read as the Accelerate config keys they stand for
(--multi_gpu is `distributed_type: MULTI_GPU`, --fsdp_X is `fsdp_config.fsdp_X`, --zero_stage is
`deepspeed_config.zero_stage`, --fp8_X is `fp8_config.X`) through the same tables as a YAML file
(compat/accelerate/config_sections.py), so a flag and its key mean one thing and are refused for one
reason. With a distribution flag the flags are the target (not with --target); precision flags
alone replace the precision parts of the target in effect. torchrun's flags pass through;
-m/--module and --no_python change how a rank starts. Flags that cannot be honoured (TPU,
Megatron-LM, MPI, SageMaker, IPEX, N-D parallelism options other than the sizes) are parsed
so that using one is an error naming it and the reason, never argparse's "unrecognized
arguments". --use_parallelism_config with --parallelism_config_{dp_replicate,dp_shard,tp}_size
is the layout those sizes give (targets/parallelism.py): tp 2 and dp_shard 2 is fsdp+tp[size=2].
As in Accelerate it goes with --use_fsdp, whose flags keep their meaning (--fsdp_offload_params,
--fsdp_activation_checkpointing, ...); --use_fsdp may be left out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import yaml

from retarget.compat.accelerate.config_sections import read_target_sections
from retarget.core.world import ACCUMULATION_ENV
from retarget.launch.config import LaunchError
from retarget.targets.errors import TargetError
from retarget.targets.grammar import Target
from retarget.targets.parallelism import CONTEXT_SIZES, SIZES
from retarget.targets.precisions import PRECISION_PART_NAMES

__all__ = ["AccelerateFlags", "add_accelerate_arguments", "with_precision_flags"]

#: Accelerate's debug switch, exported as its launcher does (our collectives always check).
DEBUG_ENV = "ACCELERATE_DEBUG_MODE"

#: Switch -> the distributed_type it stands for.
_DISTRIBUTIONS = {"multi_gpu": "MULTI_GPU", "use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED"}
#: Valued flag -> (section, key) of an Accelerate config; read by accelerate_sections' tables.
_SECTION_FLAGS: dict[str, tuple[str, str]] = {
    **{
        f"fsdp_{key}": ("fsdp_config", f"fsdp_{key}")
        for key in (
            "version", "offload_params", "min_num_params", "sharding_strategy",
            "reshard_after_forward", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
            "backward_prefetch", "state_dict_type", "forward_prefetch", "use_orig_params",
            "cpu_ram_efficient_loading", "sync_module_states", "activation_checkpointing",
        )
    },
    "fsdp_activation_checkpointing_offload": ("fsdp_config", "fsdp_activation_cpu_offload"),
    **{
        key: ("deepspeed_config", key)
        for key in (
            "zero_stage", "offload_optimizer_device", "offload_param_device",
            "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_clipping",
            "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_config_file",
            "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
            "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names",
        )
    },
    **{
        f"fp8_{key}": ("fp8_config", key)
        for key in (
            "backend", "margin", "interval", "format", "amax_history_len", "amax_compute_algo",
            "override_linear_precision", "opt_level",
        )
    },
}  # fmt: skip
_SECTION_FLAGS["fp8_format"] = ("fp8_config", "fp8_format")
#: Section switches -> (section, key), set to true when given.
_SECTION_SWITCHES = {"fp8_use_autocast_during_eval": ("fp8_config", "use_autocast_during_eval")}
#: Section -> (the distributed_type it belongs to, the flag that asks for it).
_OWNER = {
    "fsdp_config": ("FSDP", "--use_fsdp"),
    "deepspeed_config": ("DEEPSPEED", "--use_deepspeed"),
}

_TPU = "TPUs run through torch_xla's launcher; retarget launches with torchrun"
_MEGATRON = "Megatron-LM cannot be honoured (no pass implements its parallelism); use --use_fsdp"
_ND = "only the dp_replicate/dp_shard/tp/cp/sp sizes of a parallelism config are read"
#: Flags refused whatever their value: name -> (takes a value, why).
REFUSED: dict[str, tuple[bool, str]] = {
    "tpu": (False, _TPU),
    "tpu_cluster": (False, _TPU),
    "no_tpu_cluster": (False, _TPU),
    "tpu_use_sudo": (False, _TPU),
    "vm": (True, _TPU),
    "env": (True, _TPU + " (--env sets a TPU pod's environment)"),
    "main_training_function": (True, _TPU + " (xla_spawn calls a function; we run a script)"),
    "use_megatron_lm": (False, _MEGATRON),
    "mpirun_hostfile": (True, "MPI launches (mpirun) are not made; retarget launches torchrun"),
    "aws_access_key_id": (True, "SageMaker launches are not made; run retarget on the instance"),
    "aws_secret_access_key": (True, "SageMaker launches are not made; run on the instance"),
    "ipex": (False, "Intel Extension for PyTorch is not applied; torch's own CPU path runs"),
    "enable_cpu_affinity": (False, "NUMA affinity is not set; start the launch under numactl"),
}
#: --parallelism_config_<size>: read by targets/parallelism.py (N-D sizes -> the target).
_SIZES = (*SIZES, *CONTEXT_SIZES)
_PARALLELISM = ("cp_backend", "sp_backend", "sp_seq_length")
_PARALLELISM += ("sp_seq_length_is_variable", "sp_attn_implementation")
REFUSED.update({f"parallelism_config_{name}": (True, _ND) for name in _PARALLELISM})
_MEGATRON_VALUED = ("tp_degree", "pp_degree", "num_micro_batches", "sequence_parallelism")
_MEGATRON_VALUED += ("recompute_activations", "use_distributed_optimizer", "gradient_clipping")
_MEGATRON_VALUED += ("recompute_granularity", "recompute_method", "recompute_num_layers")
_MEGATRON_VALUED += ("attention_backend", "expert_model_parallel_size", "context_parallel_size")
_MEGATRON_VALUED += ("attention_dropout", "hidden_dropout", "attention_softmax_in_fp32")
_MEGATRON_VALUED += ("expert_tensor_parallel_size", "calculate_per_token_loss")
_MEGATRON_VALUED += ("use_rotary_position_embeddings", "decoder_last_pipeline_num_layers")
_MEGATRON_VALUED += ("use_custom_fsdp", "no_load_optim", "eod_mask_loss", "no_save_optim")
_MEGATRON_VALUED += ("overlap_cpu_optimizer_d2h_h2d", "optimizer_cpu_offload")
_MEGATRON_VALUED += ("use_precision_aware_optimizer",)
REFUSED.update({f"megatron_lm_{name}": (True, _MEGATRON) for name in _MEGATRON_VALUED})
_FLOAT8 = "torchao's float8 training options are not configurable here"
REFUSED.update({"fp8_enable_fsdp_float8_all_gather": (True, _FLOAT8)})
REFUSED.update({"fp8_pad_inner_dim": (True, _FLOAT8)})

#: torchrun flags passed through: name -> (short spelling or None, metavar, help).
TORCHRUN_FLAGS = {
    "monitor_interval": (None, "SECONDS", "how often torchrun checks the ranks (default 0.1)"),
    "rdzv_conf": (None, "K=V,...", "extra rendezvous configuration"),
    "tee": ("-t", "0|1|2|3", "copy ranks' stdout (1), stderr (2) or both (3) into --log_dir"),
    "log_dir": (None, "DIR", "where torchrun writes the ranks' logs"),
    "role": (None, "ROLE", "the workers' role name (default 'default')"),
}


#: Integer flags exported to the script: name -> the variable.
_EXPORTED = {
    "gradient_accumulation_steps": ACCUMULATION_ENV,
    "num_cpu_threads_per_process": "OMP_NUM_THREADS",
}


def _spellings(name: str, short: str | None = None) -> list[str]:
    dashed = f"--{name.replace('_', '-')}"
    return [f"--{name}", *([dashed] if "_" in name else []), *([short] if short else [])]


def add_accelerate_arguments(parser: argparse.ArgumentParser) -> None:
    """Every Accelerate launch flag not added by launcher.py or dynamo_flags.py."""
    switch = {"action": "store_true", "default": None}
    for name, kind in _DISTRIBUTIONS.items():
        help_text = f"distributed_type {kind}; its options (--fsdp_*, --zero_stage) as in the YAML"
        parser.add_argument(*_spellings(name), dest=name, help=help_text, **switch)
    for name in (*_SECTION_SWITCHES, "downcast_bf16", "same_network", "debug"):
        parser.add_argument(*_spellings(name), dest=name, help=argparse.SUPPRESS, **switch)
    parser.add_argument(
        *_spellings("use_parallelism_config"),
        dest="use_parallelism_config",
        help="the layout from --parallelism_config_{dp_replicate,dp_shard,tp}_size",
        **switch,
    )
    for name in _SIZES:
        flag = f"parallelism_config_{name}"
        parser.add_argument(*_spellings(flag), dest=flag, type=int, help=argparse.SUPPRESS)
    flag = "parallelism_config_cp_comm_strategy"  # cp's attention (targets/parallelism.py)
    parser.add_argument(*_spellings(flag), dest=flag, help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true", help="no launch line")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as python -m")
    parser.add_argument(
        *_spellings("no_python"), action="store_true", help="SCRIPT is a program, not Python"
    )
    for name in _SECTION_FLAGS:
        parser.add_argument(*_spellings(name), dest=name, metavar="VALUE", help=argparse.SUPPRESS)
    for name, exported in _EXPORTED.items():
        parser.add_argument(
            *_spellings(name), dest=name, type=int, metavar="N", help=f"exported as {exported}"
        )
    for name, (short, metavar, help_text) in TORCHRUN_FLAGS.items():
        parser.add_argument(*_spellings(name, short), dest=name, metavar=metavar, help=help_text)
    for name, (valued, _) in REFUSED.items():
        how: dict[str, Any] = {"metavar": "VALUE"} if valued else switch
        parser.add_argument(
            *_spellings(name), dest=f"refused_{name}", help=argparse.SUPPRESS, **how
        )


@dataclass(frozen=True, kw_only=True)
class AccelerateFlags:
    """What the flags of this module ask for, decided; built by `of`, raises LaunchError."""

    target: Target | None = None
    """The target the distribution flags say (with their precision), or None."""
    precision: Target | None = None
    """Precision parts (fp8 options, downcast) to put on the target in effect, or None."""
    torchrun: tuple[str, ...] = ()
    """torchrun arguments passed through."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables for the script, as Accelerate's launcher exports them."""
    given: tuple[str, ...] = ()
    """The flags that made `target` or `precision`, as spelled, for the launch line."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> AccelerateFlags:
        refused = [name for name in REFUSED if getattr(args, f"refused_{name}", None) is not None]
        if refused:
            raise LaunchError(
                "; ".join(f"--{name} cannot be honoured: {REFUSED[name][1]}" for name in refused)
            )
        target, precision, given = _targets(args)
        return cls(
            target=target, precision=precision, torchrun=_torchrun(args), env=_env(args),
            given=tuple(given),
        )  # fmt: skip


def _parallelism(args: argparse.Namespace, kinds: list[str]) -> tuple[dict[str, int], str] | None:
    """--use_parallelism_config's sizes (and the flags that gave them), read as the YAML
    parallelism_config section beside FSDP: Accelerate takes them only with --use_fsdp, which
    may be left out here."""
    sizes = {n: getattr(args, f"parallelism_config_{n}", None) for n in _SIZES}
    sizes["cp_comm_strategy"] = getattr(args, "parallelism_config_cp_comm_strategy", None)
    given = [f"--parallelism_config_{n}" for n, v in sizes.items() if v is not None]
    used = getattr(args, "use_parallelism_config", None)
    if not (used or given):
        return None
    if not used or kinds not in ([], ["use_fsdp"]):
        other = f"--{kinds[0]}" if kinds else "nothing: add --use_parallelism_config"
        if used:
            other += " (Accelerate reads the sizes only with --use_fsdp)"
        raise LaunchError(f"{' '.join(given) or '--use_parallelism_config'} with {other}")
    flags = " ".join(["--use_parallelism_config", *given])
    return {n: v for n, v in sizes.items() if v is not None}, flags


def _targets(args: argparse.Namespace) -> tuple[Target | None, Target | None, list[str]]:
    kinds = [name for name in _DISTRIBUTIONS if getattr(args, name, None)]
    layout = _parallelism(args, kinds)
    if len(kinds) > 1:
        raise LaunchError(f"{' and '.join(f'--{k}' for k in kinds)} both given; keep one")
    data: dict[str, Any] = {"distributed_type": _DISTRIBUTIONS[kinds[0]] if kinds else "NO"}
    keys: dict[str, str] = {}
    if layout is not None:
        data["distributed_type"], data["parallelism_config"] = "FSDP", layout[0]
        keys["parallelism_config"] = layout[1]
    for name, (section, key) in {**_SECTION_FLAGS, **_SECTION_SWITCHES}.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        owner = _OWNER.get(section)
        if owner is not None and data["distributed_type"] != owner[0]:
            raise LaunchError(f"--{name} applies only with {owner[1]}; add it")
        if name in _SECTION_FLAGS:  # a flag's text means what it would as the YAML key's value
            value = yaml.safe_load(value) if value.strip() else value
        if name == "fp8_override_linear_precision" and isinstance(value, str):  # fprop,dgrad,wgrad
            value = value.split(",")
        data.setdefault(section, {})[key] = value
        keys[f"{section}.{key}"] = f"--{name}"
        keys[section] = " ".join(filter(None, (keys.get(section), f"--{name}")))
    if kinds == ["use_deepspeed"]:  # DeepSpeedPlugin's default stage when none is given
        data.setdefault("deepspeed_config", {}).setdefault("zero_stage", 2)
    mixed = getattr(args, "mixed_precision", None)
    data["mixed_precision"] = mixed or "no"
    data["downcast_bf16"] = bool(getattr(args, "downcast_bf16", None))
    keys.update(mixed_precision="--mixed_precision", downcast_bf16="--downcast_bf16")
    try:
        target = read_target_sections(data, "retarget launch")
    except TargetError as error:
        flag = keys.get(error.part or "") or " ".join(sorted(_given(args)))
        raise LaunchError(f"{flag}: {str(error).split(': ', 2)[-1]}") from None
    given = [f"--{name}" for name in kinds] + sorted(set(keys.values()) & _given(args))
    if layout is not None:
        given.insert(0, "--use_parallelism_config")
    if kinds or layout is not None:
        return target, None, given
    if "fp8_config" in data or data["downcast_bf16"]:
        return None, _precision_parts(target), [g for g in given if g != "--mixed_precision"]
    return None, None, []


def _given(args: argparse.Namespace) -> set[str]:
    names = [*_SECTION_FLAGS, *_SECTION_SWITCHES, "mixed_precision", "downcast_bf16"]
    return {f"--{name}" for name in names if getattr(args, name, None)}


def _precision_parts(target: Target) -> Target:
    return Target(tuple(p for p in target.parts if p.name in PRECISION_PART_NAMES))


def with_precision_flags(
    target: Target, origin: str, flags: AccelerateFlags | None
) -> tuple[Target, str]:
    """The target in effect with the precision flags' parts in place of its own."""
    if flags is None or flags.precision is None:
        return target, origin
    kept = [part for part in target.parts if part.name not in PRECISION_PART_NAMES]
    result = Target((*kept, *flags.precision.parts))
    return result, f"{origin} with {' '.join(flags.given)}"


def _torchrun(args: argparse.Namespace) -> tuple[str, ...]:
    passed: list[str] = []
    for name in TORCHRUN_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            passed += [f"--{name}", str(value)]
    return tuple(passed)


def _env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    for name, exported in _EXPORTED.items():
        value = getattr(args, name, None)
        if value is not None:
            if value < 1:
                raise LaunchError(f"--{name} is {value}; it must be >= 1")
            env[exported] = str(value)
    if getattr(args, "debug", None):  # retarget's collectives always check shapes across ranks
        env[DEBUG_ENV] = "true"
    return env
