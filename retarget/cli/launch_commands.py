"""The subcommands that launch training: `launch`, `config` (the settings launch reads), `env`.

retarget launch --num_processes 2 --mixed_precision bf16 train.py --lr 3e-4
retarget config --default && retarget env
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from retarget.cli.commands import CliError, Handler, command
from retarget.launch import command_line, env
from retarget.launch import launcher as launch
from retarget.launch import questions as config_questions
from retarget.launch.config import CONFIG_ENV, LaunchError


@command("launch", "run a training script on N processes (torchrun underneath)")
def launch_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget launch [--num_processes N] [...] script.py [script args]` (Accelerate's flags)."""
    command_line.add_arguments(parser)
    return run_launch


def run_launch(args: argparse.Namespace) -> int:
    """Decide the launch (a bad setting stops here, exit 2), say what runs, run it."""
    with launch_errors():
        plan = command_line.plan_from_args(args)
    if not args.quiet:
        print(launch.describe(plan), file=sys.stderr, flush=True)
    return launch.run(plan)


@command("config", "write the settings `retarget launch` reads (asks questions; or --default)")
def config_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget config [--default] [--config_file F]`."""
    parser.add_argument(
        "--config_file",
        "--config-file",
        metavar="FILE",
        help=f"where to write (default: ${CONFIG_ENV}, else ~/.cache/retarget/default_config.yaml)",
    )
    parser.add_argument(
        "--default",
        action="store_true",
        help="no questions: this machine, one process per GPU (one on a CPU); never overwrites",
    )
    return run_config


def run_config(args: argparse.Namespace) -> int:
    """Ask (or take this machine's default), write the file, print where."""
    with launch_errors():
        path = config_questions.configure(args.config_file, default=args.default)
    print(f"wrote {path}")
    return 0


@command("env", "print versions, devices and the launch config in effect, for bug reports")
def env_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget env [--config_file F]`."""
    parser.add_argument("--config_file", "--config-file", metavar="FILE", help="as for launch")
    return lambda args: print(env.env_report(args.config_file), end="") or 0


@contextlib.contextmanager
def launch_errors() -> Iterator[None]:
    """A bad launch setting, config file or script is a usage error: one line, exit 2."""
    try:
        yield
    except LaunchError as exc:
        raise CliError(str(exc)) from None
