"""Accelerate config files (what ``accelerate config`` writes) read into an AccelerateConfig.

Existing configs keep working, and nothing in them is dropped silently: every key is mapped to
the target or to the launch settings, ignored because its value is a no-op (false, empty,
``main``, ...), or refused with the reason. Unknown keys are errors, as in Accelerate.

The keys that say the target (distributed_type, mixed_precision, fsdp_config, deepspeed_config,
tp_config, parallelism_config, fp8_config, dynamo_config) are read by config_sections.py,
whose docstring maps each of them; this module reads the file, the launch settings
(num_processes, num_machines, machine_rank, main_process_ip/port, gradient_accumulation_steps,
use_cpu, gpu_ids, rdzv_backend) and refuses the top-level keys nothing here can honour (TPU
pods, Megatron-LM, mpirun, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from retarget.compat.accelerate.config_keys import (
    AccelerateFile,
    Handler,
    Parts,
    accepted,
    apply_keys,
    as_bool,
    as_int,
    as_text,
    read_elsewhere,
    read_section,
    refused_unless,
    word_map,
)
from retarget.compat.accelerate.config_sections import (
    read_distribution,
    read_dynamo,
    read_precision,
)
from retarget.targets.errors import TargetError
from retarget.targets.grammar import Target

__all__ = [
    "AccelerateConfig",
    "read_accelerate_config",
    "target_from_yaml",
]


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


_TPU = "launching on TPU pods is not supported"
# Every top-level key: read by a section reader (read_elsewhere), kept, or accepted only as a
# no-op.
_TOP_KEYS: dict[str, Handler] = {
    **dict.fromkeys(
        ("compute_environment", "distributed_type", "mixed_precision", "fp16", "downcast_bf16")
        + ("fsdp_config", "deepspeed_config", "tp_config", "fp8_config", "dynamo_config")
        + ("dynamo_backend", "num_processes", "num_machines", "machine_rank", "use_cpu")
        + ("main_process_ip", "main_process_port", "gradient_accumulation_steps", "gpu_ids")
        + ("rdzv_backend", "parallelism_config"),
        read_elsewhere,
    ),
    "same_network": accepted(as_bool),  # only decides whether Accelerate asks for rdzv_backend
    "debug": refused_unless(
        why="distributed debug checks (ACCELERATE_DEBUG_MODE) are not implemented"
    ),
    "enable_cpu_affinity": refused_unless(why="NUMA CPU affinity is not implemented"),
    "main_training_function": refused_unless(
        "main", why="retarget runs the script, not a function"
    ),
    **dict.fromkeys(
        ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo"), refused_unless(why=_TPU)
    ),
    **dict.fromkeys(("tpu_vm", "tpu_env", "commands", "command_file"), refused_unless(why=_TPU)),
    "megatron_lm_config": refused_unless(why="Megatron-LM is not supported"),
    "ipex_config": refused_unless(why="Intel Extension for PyTorch is not supported"),
    "mpirun_config": refused_unless(why="retarget launches with torchrun, not mpirun"),
}
_ENVIRONMENTS = {"LOCAL_MACHINE": False, "AMAZON_SAGEMAKER": True}


def _gradient_accumulation(file: AccelerateFile) -> int:
    key = "gradient_accumulation_steps"
    top, deepspeed = file.data.get(key), read_section(file, "deepspeed_config").get(key)
    if None not in (top, deepspeed) and top != deepspeed:
        file.fail(key, f"{top!r} differs from deepspeed_config.{key} {deepspeed!r}; keep one")
    if top is None and deepspeed is not None:
        return as_int(file, f"deepspeed_config.{key}", deepspeed, low=1)
    return as_int(file, key, 1 if top is None else top, low=1)


def _launch(file: AccelerateFile, kind: str) -> dict[str, Any]:
    data = file.data
    machines = as_int(file, "num_machines", data.get("num_machines", 1), low=1)
    rank = as_int(file, "machine_rank", data.get("machine_rank", 0))
    if rank >= machines:
        file.fail("machine_rank", f"must be below num_machines ({machines}), got {rank}")
    processes = data.get("num_processes")
    processes = None if processes in (None, -1) else as_int(file, "num_processes", processes, 1)
    if kind == "NO" and processes not in (None, 1):
        file.fail("num_processes", f"distributed_type NO runs one process, got {processes}")
    port = data.get("main_process_port")
    if port is not None and not 0 < as_int(file, "main_process_port", port) < 65536:
        file.fail("main_process_port", f"must be a port number in 1..65535, got {port}")
    return {
        "num_processes": 1 if kind == "NO" else processes,
        "num_machines": machines,
        "machine_rank": rank,
        "main_process_ip": as_text(file, "main_process_ip", data.get("main_process_ip")),
        "main_process_port": None if port is None else int(port),
        "gradient_accumulation_steps": _gradient_accumulation(file),
        "use_cpu": as_bool(file, "use_cpu", data.get("use_cpu", False)),
        "gpu_ids": as_text(file, "gpu_ids", data.get("gpu_ids")),
        "rdzv_backend": as_text(file, "rdzv_backend", data.get("rdzv_backend")) or "static",
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
    file = AccelerateFile(_load(source), source)
    parts: Parts = {}
    apply_keys(file, "", file.data, _TOP_KEYS, parts, "single")
    environment = file.data.get("compute_environment", "LOCAL_MACHINE")
    if word_map(_ENVIRONMENTS)(file, "compute_environment", environment):
        file.fail("compute_environment", f"{environment} cannot be honoured: run on the machine")
    kind = read_distribution(file, parts)
    read_precision(file, parts)
    read_dynamo(file, parts)
    try:
        target = Target.from_dict(parts)
    except TargetError as err:
        raise TargetError(f"{source}: {err}", part=err.part) from None
    return AccelerateConfig(target=target, source=source, **_launch(file, kind))


def target_from_yaml(path: str | os.PathLike[str]) -> Target:
    """The target of an Accelerate config file: ``read_accelerate_config(path).target``.

    ``retarget.target_from_yaml("default_config.yaml")`` -> ``Target('fsdp+bf16')``.
    """
    return read_accelerate_config(path).target
