"""`retarget launch`'s command line: its flags, parsed into a LaunchPlan.

    plan = plan_from_args(build_parser().parse_args(["launch", "--multi_gpu", "train.py"]))

Accelerate's flag names, each also with dashes: the settings of launch/config.py (--num_processes,
--mixed_precision, ...), --target, --config_file, the --dynamo_* flags (dynamo_flags.py) and
the rest of Accelerate's launch flags (accelerate_flags.py: honoured, or refused by name).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from retarget.launch.accelerate_flags import AccelerateFlags, add_accelerate_arguments
from retarget.launch.config import RDZV_BACKENDS, SETTINGS, LaunchError, read_settings
from retarget.launch.dynamo_flags import DynamoFlags, add_dynamo_arguments
from retarget.launch.launcher import LaunchPlan, resolve
from retarget.launch.reachability import DEFAULT_JOIN_TIMEOUT_S
from retarget.targets.precisions import MIXED_PRECISION

__all__ = ["add_arguments", "plan_from_args"]

#: Flag spellings per setting (Accelerate's names; each also with dashes).
_FLAG_NAMES = {name: (f"--{name}",) for name in SETTINGS}
_FLAG_NAMES.update(use_cpu=("--cpu", "--use_cpu"))
#: Per setting: metavar and help.
_FLAG_HELP = {
    "target": ("SPEC", "target spec, e.g. fsdp+bf16 (default: single for 1 process, else ddp)"),
    "num_processes": ("N", "processes over all machines (default 1)"),
    "num_machines": ("M", "machines taking part (default 1)"),
    "machine_rank": ("R", "this machine's rank, 0 .. M-1 (default 0)"),
    "main_process_ip": (
        "IP",
        "address of the rank-0 machine (default 127.0.0.1; needed for M > 1)",
    ),
    "main_process_port": ("PORT", "its port (default: a free port on one machine, else 29500)"),
    "mixed_precision": ("|".join(MIXED_PRECISION), "replaces the target's precision parts"),
    "use_cpu": (None, "hide accelerators from the script (CUDA_VISIBLE_DEVICES='')"),
    "gpu_ids": ("IDS", "devices of this machine to use, e.g. 0,1 (default all)"),
    "rdzv_backend": (
        "|".join(RDZV_BACKENDS),
        "torchrun rendezvous (default static)",
    ),
    "max_restarts": (
        "N",
        "restart every rank up to N times after one fails (default 0); the script resumes "
        "with resume_from_latest / load_state",
    ),
    "join_timeout": (
        "SECONDS",
        f"how long a machine waits for the main machine to answer (default "
        f"{DEFAULT_JOIN_TIMEOUT_S})",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `retarget launch` flags, then the script and its untouched arguments."""
    for name, spellings in _FLAG_NAMES.items():
        names = [*spellings, *(s.replace("_", "-") for s in spellings if "_" in s)]
        metavar, help_text = _FLAG_HELP[name]
        if metavar is None:
            parser.add_argument(
                *names, dest=name, action="store_true", default=None, help=help_text
            )
        else:
            parser.add_argument(*names, dest=name, metavar=metavar, help=help_text)
    parser.add_argument(
        "--config_file",
        "--config-file",
        metavar="FILE",
        help="launch settings (ours or an Accelerate config; default: $RETARGET_CONFIG, else "
        "~/.cache/retarget/default_config.yaml if it exists)",
    )
    add_dynamo_arguments(parser)
    add_accelerate_arguments(parser)
    parser.add_argument(
        "script", help="the training script (a module with -m, a program with --no_python)"
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def plan_from_args(args: argparse.Namespace) -> LaunchPlan:
    """The plan for parsed `retarget launch` arguments; raises LaunchError."""
    flags = read_settings(
        {name: getattr(args, name) for name in SETTINGS}, lambda name: _FLAG_NAMES[name][0]
    )
    accelerate = AccelerateFlags.of(args)
    if accelerate.target is not None:  # the distribution flags say the target, precision in it
        if flags.target is not None:
            raise LaunchError(f"--target and {accelerate.given[0]} both say the target; keep one")
        origins = {**flags.origins, "target": " ".join(accelerate.given)}
        # --mixed_precision stays: it agrees with the target's parts, and an explicit `no` must
        # win over a config file's precision when merged.
        flags = replace(flags, target=accelerate.target, origins=origins)
    if args.module and args.no_python:
        raise LaunchError("-m/--module and --no_python both given; keep one")
    run_as = "module" if args.module else "program" if args.no_python else "script"
    return resolve(
        args.script,
        args.script_args,
        flags=flags,
        config_file=args.config_file,
        dynamo=DynamoFlags.of(args),
        accelerate=accelerate,
        run_as=run_as,
    )
