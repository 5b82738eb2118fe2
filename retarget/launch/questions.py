"""`retarget config`: ask for the launch settings (or take this machine's default) and write them.

    $ retarget config                      # questions; an empty answer takes [the default]
    $ retarget config --default            # no questions: this machine, every accelerator
    $ retarget config --config_file f.yaml

The file goes to `--config_file`, else `$RETARGET_CONFIG`, else
~/.cache/retarget/default_config.yaml, in the format of `retarget.launch.config`. Every
answer is checked by the rules a config file is checked with, and a bad one is asked again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from retarget.launch.config import (
    SETTINGS,
    LaunchConfig,
    LaunchError,
    check_combination,
    default_config_path,
    write_launch_config,
)
from retarget.targets.grammar import Target
from retarget.targets.precisions import MIXED_PRECISION, precision_of

__all__ = ["ask_launch_config", "configure", "default_launch_config"]


def default_launch_config() -> LaunchConfig:
    """What `retarget config --default` writes: this machine alone, every accelerator in use.

    One process per CUDA device (ddp when there are several); on a CPU-only machine one process,
    which uses every core through intra-op threads (as `accelerate config default` does: gloo
    ranks per core would be slower than threads).
    """
    devices = _local_devices()
    return LaunchConfig(
        target=Target.parse("ddp" if devices > 1 else "single"),
        num_processes=devices,
        num_machines=1,
        machine_rank=0,
        mixed_precision="no",
    )


@dataclass(frozen=True)
class _Question:
    name: str
    """The setting it answers."""
    prompt: str
    default: Callable[[dict[str, Any]], str | None]
    """The answer an empty line gives, from the answers so far (None: an answer is needed)."""
    asked: Callable[[dict[str, Any]], bool] = lambda answers: True
    """Whether to ask, given the answers so far."""


def _several_machines(answers: dict[str, Any]) -> bool:
    return answers["num_machines"] > 1


_QUESTIONS = (
    _Question("num_machines", "How many machines take part?", lambda a: "1"),
    _Question(
        "machine_rank",
        "Rank of this machine (0 is the main one)?",
        lambda a: "0",
        _several_machines,
    ),
    _Question(
        "main_process_ip", "IP address of the rank-0 machine?", lambda a: None, _several_machines
    ),
    _Question(
        "main_process_port", "Port on the rank-0 machine?", lambda a: "29500", _several_machines
    ),
    _Question(
        "num_processes",
        "How many processes in all, over every machine (one per GPU)?",
        lambda a: str(_local_devices() * a["num_machines"]),
    ),
    _Question(
        "target",
        "Target: distribution and options (e.g. ddp, fsdp, zero2, fsdp+ac; see the README)?",
        lambda a: "ddp" if a["num_processes"] > 1 else "single",
    ),
    _Question(
        "mixed_precision",
        f"Mixed precision ({', '.join(MIXED_PRECISION)})?",
        lambda a: precision_of(a["target"]) or "no",
    ),
)


def _local_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def ask_launch_config(
    ask: Callable[[str], str] = input, say: Callable[[str], Any] = print
) -> LaunchConfig:
    """Ask for each setting (an empty answer takes the default in brackets); re-ask bad answers.

    Each answer is checked with the rules a config file is checked with. End of input before
    the last answer is a LaunchError (use `retarget config --default` where nobody answers).
    """
    answers: dict[str, Any] = {}
    for question in _QUESTIONS:
        if question.asked(answers):
            answers[question.name] = _answer(question, answers, ask, say)
    return LaunchConfig(**answers)


def _answer(question: _Question, answers: dict[str, Any], ask, say) -> Any:
    default = question.default(answers)
    prompt = f"{question.prompt} [{default}] " if default is not None else f"{question.prompt} "
    while True:
        try:
            text = ask(prompt).strip() or default
        except EOFError:
            raise LaunchError(
                f"no answer to {question.prompt!r} (end of input); answer every question, or "
                "run `retarget config --default`"
            ) from None
        if text is None:
            say("  an answer is needed")
            continue
        try:
            value = SETTINGS[question.name](question.name, text)
            check_combination(LaunchConfig(**answers, **{question.name: value}))
        except LaunchError as err:
            say(f"  {err}")
            continue
        return value


def configure(
    config_file: str | None = None, *, default: bool = False, ask=input, say=print
) -> Path:
    """`retarget config`: ask (or take the machine's default) and write the file; its path.

    `default=True` never overwrites an existing file (as `accelerate config default`).
    """
    path = Path(config_file).expanduser() if config_file else default_config_path()
    if default:
        if path.exists():
            raise LaunchError(
                f"{path} exists; --default does not overwrite: delete it, or pass another "
                "--config_file"
            )
        return write_launch_config(default_launch_config(), path)
    say(f"Launch settings for `retarget launch`, written to {path}")
    return write_launch_config(ask_launch_config(ask, say), path)
