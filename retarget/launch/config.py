"""Launch settings: what `retarget config` writes and `retarget launch` reads.

Our config file is a small YAML mapping; every key is optional and unknown keys are errors:

    target: fsdp+ac            # the target spec (retarget.parse_target grammar)
    num_processes: 8           # processes over all machines
    num_machines: 1
    machine_rank: 0            # this machine's rank, 0 <= machine_rank < num_machines
    main_process_ip: null      # address of the rank-0 machine (needed with num_machines > 1)
    main_process_port: null    # its port (a free port on one machine, else 29500)
    mixed_precision: bf16      # no | bf16 | fp16 | fp8, folded into the target
    use_cpu: false             # hide accelerators from the script (CUDA_VISIBLE_DEVICES="")
    gpu_ids: all               # devices of this machine to use, e.g. "0,1"
    rdzv_backend: static       # torchrun rendezvous: static (master address) or c10d

A file with `distributed_type` or `compute_environment` (and no `target`) is an Accelerate config
and is read by `retarget.compat.accelerate.config_yaml`, so existing `accelerate config` files keep
working.

Where the file is: `--config_file F`, else `$RETARGET_CONFIG`, else
`~/.cache/retarget/default_config.yaml` when it exists. Each setting comes from the first of:
command-line flag, that file, the default (see `retarget.launch.launcher.resolve`).
`LaunchConfig` holds the settings of one source (the flags, or one file), None where unset.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from retarget.compat.accelerate.config_yaml import read_accelerate_config
from retarget.targets.errors import ConfigError
from retarget.targets.grammar import Target, TargetError, parse_target
from retarget.targets.precisions import MIXED_PRECISION, precision_of, with_precision
from retarget.targets.values import parse_bool

__all__ = [
    "CONFIG_ENV",
    "RDZV_BACKENDS",
    "SETTINGS",
    "LaunchConfig",
    "LaunchError",
    "check_combination",
    "config_in_effect",
    "default_config_path",
    "merged",
    "read_launch_config",
    "read_settings",
    "runs_one_process",
    "write_launch_config",
]

#: Environment variable naming the default config file (instead of the location below).
CONFIG_ENV = "RETARGET_CONFIG"
DEFAULT_CONFIG = Path("~/.cache/retarget/default_config.yaml")
RDZV_BACKENDS = ("static", "c10d")
_ACCELERATE_KEYS = ("distributed_type", "compute_environment")


class LaunchError(ConfigError):
    """A launch setting or request that cannot be used: names the flag, key or path, and the fix.

    Raised before anything is started; `retarget launch` prints it as one line and exits 2.
    """


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Launch settings from one source; a field left None is not set there."""

    target: Target | None = None
    """What the script trains for; exported to it as RETARGET_TARGET."""
    num_processes: int | None = None
    """Processes over all machines (torchrun's nproc_per_node times num_machines)."""
    num_machines: int | None = None
    """Machines (torchrun nodes) taking part."""
    machine_rank: int | None = None
    """This machine's rank among them."""
    main_process_ip: str | None = None
    """Address of the rank-0 machine; 127.0.0.1 on one machine."""
    main_process_port: int | None = None
    """Port of the rank-0 machine; a free port on one machine, else 29500."""
    mixed_precision: str | None = None
    """no | bf16 | fp16 | fp8: replaces the precision parts of the target (fp8 = bf16+fp8)."""
    use_cpu: bool | None = None
    """Hide accelerators from the script (CUDA_VISIBLE_DEVICES is set empty)."""
    gpu_ids: str | None = None
    """Comma-separated device indices of this machine to use, or "all"."""
    rdzv_backend: str | None = None
    """torchrun rendezvous backend: static (master address and port) or c10d."""
    max_restarts: int | None = None
    """Times torchrun's elastic agent restarts every rank after one fails (default 0)."""
    join_timeout: int | None = None
    """Seconds a machine waits to reach the main machine's rendezvous (default 600)."""
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each set field was read, e.g. {"target": "--target"}: errors name it."""

    def origin(self, name: str) -> str:
        """Where `name` was set, for messages: "--num_processes" or "/path/f.yaml: target"."""
        return self.origins.get(name, name)

    def settings(self) -> dict[str, Any]:
        """The fields that are set, in declaration order (origins left out)."""
        return {name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None}


# ------------------------------------------------------------------------------ values
def _integer(low: int, high: int | None = None) -> Callable[[str, Any], int]:
    bound = f"between {low} and {high}" if high else f"at least {low}"

    def convert(where: str, raw: Any) -> int:
        text = str(raw).strip()
        if isinstance(raw, bool) or not re.fullmatch(r"[+-]?[0-9]+", text, re.ASCII):
            raise LaunchError(f"{where}: expected an integer {bound}, got {raw!r}")
        value = int(text)
        if value < low or (high is not None and value > high):
            raise LaunchError(f"{where}: must be {bound}, got {value}")
        return value

    return convert


def _choice(words: tuple[str, ...]) -> Callable[[str, Any], str]:
    def convert(where: str, raw: Any) -> str:
        word = "no" if raw is False else str(raw).strip().lower()  # YAML reads a bare `no` false
        if word not in words:
            close = difflib.get_close_matches(word, words, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise LaunchError(f"{where}: {raw!r} is not one of {', '.join(words)}{hint}")
        return word

    return convert


def _boolean(where: str, raw: Any) -> bool:
    try:
        return parse_bool(raw, what=where)
    except ValueError as error:
        raise LaunchError(str(error)) from None


def _text(where: str, raw: Any) -> str:
    if isinstance(raw, bool) or not isinstance(raw, (str, int)) or not str(raw).strip():
        raise LaunchError(f"{where}: expected a non-empty string, got {raw!r}")
    return str(raw).strip()


def _gpu_ids(where: str, raw: Any) -> str:
    text = _text(where, raw).replace(" ", "")
    if text.lower() != "all" and not re.fullmatch(r"[0-9]+(,[0-9]+)*", text, re.ASCII):
        raise LaunchError(f"{where}: expected 'all' or indices like '0,1', got {raw!r}")
    return text.lower()


def _target(where: str, raw: Any) -> Target:
    if isinstance(raw, Target):
        return raw
    try:
        return parse_target(_text(where, raw))
    except TargetError as err:
        raise LaunchError(f"{where}: {err}") from None


#: Every setting: how a flag or file value is read.
SETTINGS: dict[str, Callable[[str, Any], Any]] = {
    "target": _target,
    "num_processes": _integer(1),
    "num_machines": _integer(1),
    "machine_rank": _integer(0),
    "main_process_ip": _text,
    "main_process_port": _integer(1, 65535),
    "mixed_precision": _choice(MIXED_PRECISION),
    "use_cpu": _boolean,
    "gpu_ids": _gpu_ids,
    "rdzv_backend": _choice(RDZV_BACKENDS),
    "max_restarts": _integer(0),
    "join_timeout": _integer(1),
}
assert set(SETTINGS) == {f.name for f in fields(LaunchConfig)} - {"origins"}


def read_settings(values: Mapping[str, Any], where: Callable[[str], str]) -> LaunchConfig:
    """Convert raw values (flags or file keys; None = unset) into a checked LaunchConfig."""
    converted = {
        name: SETTINGS[name](where(name), raw) for name, raw in values.items() if raw is not None
    }
    config = LaunchConfig(**converted, origins={name: where(name) for name in converted})
    check_combination(config)
    return config


# ------------------------------------------------------------------------------ rules
def runs_one_process(target: Target) -> bool:
    """Whether the target has no distribution part (it trains in a world of one)."""
    return target.strategy == "single" and "tp" not in target and "pp" not in target


def check_combination(config: LaunchConfig) -> None:
    """Rules between settings, checked on those that are set; raises LaunchError."""
    c, at = config, config.origin
    if None not in (c.machine_rank, c.num_machines) and c.machine_rank >= c.num_machines:
        raise LaunchError(
            f"{at('machine_rank')} is {c.machine_rank} but {at('num_machines')} is "
            f"{c.num_machines}: machine ranks run from 0 to {c.num_machines - 1}"
        )
    if None not in (c.num_processes, c.num_machines) and c.num_processes % c.num_machines:
        raise LaunchError(
            f"{at('num_processes')} is {c.num_processes}, not a multiple of "
            f"{at('num_machines')} ({c.num_machines}): every machine runs as many processes"
        )
    if c.target is not None and (c.num_processes or 1) > 1 and runs_one_process(c.target):
        raise LaunchError(
            f"{at('target')} '{c.target}' has no distribution part, so it trains in one process, "
            f"but {at('num_processes')} is {c.num_processes}; use e.g. "
            f"'{with_precision(Target.parse('ddp'), precision_of(c.target) or 'no')}' or fsdp"
        )
    stated = c.target and precision_of(c.target)
    if c.mixed_precision and stated and stated != c.mixed_precision:
        raise LaunchError(
            f"{at('target')} '{c.target}' says {stated} but {at('mixed_precision')} says "
            f"{c.mixed_precision}; keep one"
        )
    if c.use_cpu and c.gpu_ids not in (None, "all"):
        raise LaunchError(
            f"{at('use_cpu')} hides the GPUs that {at('gpu_ids')} ({c.gpu_ids}) selects; keep one"
        )


# ------------------------------------------------------------------------------ files
def default_config_path() -> Path:
    """`$RETARGET_CONFIG`, else ~/.cache/retarget/default_config.yaml (which may not exist)."""
    named = os.environ.get(CONFIG_ENV)
    return Path(named).expanduser() if named else DEFAULT_CONFIG.expanduser()


def config_in_effect(config_file: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file `retarget launch` reads: `config_file`, else the default one, else None.

    A file that is named (by `--config_file` or `$RETARGET_CONFIG`) must exist; the default
    location is optional.
    """
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise LaunchError(f"--config_file {config_file}: no such file")
        return path
    path = default_config_path()
    if path.is_file():
        return path
    if os.environ.get(CONFIG_ENV):
        raise LaunchError(
            f"${CONFIG_ENV} names {path}, which does not exist; write it with `retarget config` "
            f"or unset {CONFIG_ENV}"
        )
    return None


def read_launch_config(path: str | os.PathLike[str]) -> LaunchConfig:
    """Read our config file, or an Accelerate one; raises LaunchError naming the key."""
    source = os.fspath(path)
    data = _load(source)
    if "target" not in data and any(key in data for key in _ACCELERATE_KEYS):
        return _from_accelerate(source)
    for key in data:
        if key not in SETTINGS:
            close = difflib.get_close_matches(str(key), list(SETTINGS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(SETTINGS)}"
            raise LaunchError(
                f"{source}: unknown key {key!r}; {hint} (an Accelerate config is recognised by "
                "its distributed_type key)"
            )
    return read_settings(data, lambda name: f"{source}: {name}")


def _load(source: str) -> dict[str, Any]:
    try:
        with open(source, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        raise LaunchError(f"{source}: no such config file") from None
    except yaml.YAMLError as err:
        raise LaunchError(f"{source}: not valid YAML: {err}".replace("\n", " ")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LaunchError(f"{source}: expected a mapping of settings, got {data!r}")
    return data


def _from_accelerate(source: str) -> LaunchConfig:
    try:
        accelerate = read_accelerate_config(source)
    except TargetError as err:
        raise LaunchError(str(err)) from None
    if accelerate.gradient_accumulation_steps != 1:
        raise LaunchError(
            f"{source}: gradient_accumulation_steps is read by Accelerate's Accelerator, not by "
            f"the launcher; remove it and accumulate {accelerate.gradient_accumulation_steps} "
            "micro-batches in the script (run.accumulate())"
        )
    values = {name: getattr(accelerate, name, None) for name in SETTINGS}
    values.update(
        mixed_precision=None,
        gpu_ids=None if accelerate.gpu_ids in (None, "all") else accelerate.gpu_ids,
    )
    return read_settings(values, lambda name: f"{source}: {name}")


def write_launch_config(config: LaunchConfig, path: str | os.PathLike[str]) -> Path:
    """Write the settings that are set as our YAML format; returns the path written."""
    path = Path(path).expanduser()
    values = {k: str(v) if isinstance(v, Target) else v for k, v in config.settings().items()}
    header = "# retarget launch settings (written by `retarget config`; see `retarget launch -h`)\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
    return path


def merged(layers: list[LaunchConfig]) -> LaunchConfig:
    """One config from `layers`, highest precedence first: each field from the first that sets it.

    A target is taken whole (`--target ddp` over a file's `fsdp+bf16` is ddp). The precision is
    the first stated: a layer's mixed_precision, or the precision parts of the target in effect
    in its own layer; it is folded into the target, so the result's mixed_precision is None
    (unless no layer names a target).
    """
    chosen: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in reversed(layers):
        chosen.update(layer.settings())
        origins.update({name: layer.origin(name) for name in layer.settings()})
    chosen.pop("mixed_precision", None)
    origins.pop("mixed_precision", None)
    stated = _stated_precision(layers, chosen.get("target"))
    if stated and "target" in chosen:
        folded = with_precision(chosen["target"], stated[0])
        if folded != chosen["target"]:
            origins["target"] = f"{origins['target']} with {stated[1]} {stated[0]}"
        chosen["target"] = folded
    elif stated:
        chosen["mixed_precision"], origins["mixed_precision"] = stated
    return replace(LaunchConfig(**chosen), origins=origins)


def _stated_precision(layers: list[LaunchConfig], target: Target | None) -> tuple[str, str] | None:
    """(precision, where) from the first layer stating one, or None."""
    for layer in layers:
        if layer.mixed_precision:
            return layer.mixed_precision, layer.origin("mixed_precision")
        if layer.target is not None and layer.target is target and precision_of(target):
            return precision_of(target), layer.origin("target")
    return None
