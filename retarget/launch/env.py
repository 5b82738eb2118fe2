"""`retarget env`: the facts a bug report needs, as Markdown to paste into an issue.

    $ retarget env
    Copy and paste the text below into your bug report.

    - retarget: 0.1.0
    - Python: 3.11.7 (CPython)
    - torch: 2.13.0+cpu (CUDA build: none)
    - transformer_engine: not installed
    - GPUs: none
    - distributed backends: gloo
    - launch config: none
    ...

Versions come from the installed distributions' metadata (no package is imported, so a broken
optional package cannot break the report). The config in effect is found as `retarget launch`
finds it; an invalid one is shown with its error instead of failing the report.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from retarget.core.errors import TargetNotSupportedError
from retarget.core.version import __version__
from retarget.core.world import TARGET_ENV
from retarget.execution import xla_device as xla
from retarget.launch.config import (
    CONFIG_ENV,
    LaunchError,
    config_in_effect,
    read_launch_config,
)

__all__ = ["env_report"]

#: Optional packages whose presence changes what runs: shown name -> distribution names.
OPTIONAL_PACKAGES = {
    "transformers": ("transformers",),
    "torchao": ("torchao",),
    "transformer_engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "msamp": ("msamp", "ms-amp"),
    "torch-xla": ("torch-xla", "torch_xla"),
    "numpy": ("numpy",),
    "networkx": ("networkx",),
}
#: Process-group backends torch may have been built with.
_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
HEADER = "Copy and paste the text below into your bug report.\n"


def env_report(config_file: str | os.PathLike[str] | None = None) -> str:
    """The report `retarget env` prints; `config_file` as `retarget launch --config_file`."""
    items = [
        ("retarget", __version__),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"),
        *((name, _version(dists)) for name, dists in OPTIONAL_PACKAGES.items()),
        ("CPUs", _cpus()),
        *_devices(),
        *_xla_devices(),
        ("distributed backends", ", ".join(_backends()) or "none"),
        (TARGET_ENV, os.environ.get(TARGET_ENV) or "not set"),
        (CONFIG_ENV, os.environ.get(CONFIG_ENV) or "not set"),
    ]
    lines = [f"- {key}: {value}" for key, value in items]
    lines += _config_lines(config_file)
    return HEADER + "\n" + "\n".join(lines) + "\n"


def _version(distributions: tuple[str, ...]) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpus() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    count = os.cpu_count()
    return f"{count}" if usable in (None, count) else f"{count} ({usable} usable by this process)"


def _devices() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        found = [("CUDA available", "no"), ("GPUs", "none")]
    else:
        gpus = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            memory = props.total_memory / 2**30
            gpus.append(f"{index}: {props.name} ({memory:.0f} GiB, sm_{props.major}{props.minor})")
        found = [
            ("CUDA available", f"yes, cuDNN {torch.backends.cudnn.version()}"),
            (f"GPUs ({len(gpus)})", "; ".join(gpus)),
            ("bf16 supported", "yes" if torch.cuda.is_bf16_supported() else "no"),
        ]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append(("MPS available", "yes"))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found.append(("XPU devices", str(torch.xpu.device_count())))
    return found


def _xla_devices() -> list[tuple[str, str]]:
    """The XLA devices PJRT sees, when torch-xla is installed (nothing otherwise)."""
    if importlib.util.find_spec("torch_xla") is None:
        return []
    try:
        xla.torch_xla_or_refuse()
    except TargetNotSupportedError as error:
        return [("XLA devices", f"none: {str(error).split('; install')[0]}")]
    if not os.environ.get("PJRT_DEVICE"):
        return [("XLA devices", "not queried: set PJRT_DEVICE (TPU, CUDA or CPU)")]
    return [("XLA devices", f"{xla.device_count()} ({xla.platform()})")]


def _backends() -> list[str]:
    if not dist.is_available():
        return []
    checks = {name: getattr(dist, f"is_{name}_available", None) for name in _BACKENDS}
    return [name for name, available in checks.items() if available is not None and available()]


def _config_lines(config_file: str | os.PathLike[str] | None) -> list[str]:
    try:
        path = config_in_effect(config_file)
    except LaunchError as err:
        return [f"- launch config: invalid: {err}"]
    if path is None:
        return ["- launch config: none"]
    lines = [f"- launch config: {path}"]
    text = Path(path).read_text(encoding="utf-8")
    lines += [f"    {line}" for line in text.splitlines() if line.strip()]
    try:
        read_launch_config(path)
    except LaunchError as err:
        lines.append(f"    (invalid: {err})")
    return lines
