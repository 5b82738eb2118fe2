"""The subcommands that launch training: `launch`, `config` (the settings launch reads), `env`,
and `test` (a distributed sanity run).

retarget launch --num_processes 2 --mixed_precision bf16 train.py --lr 3e-4
retarget config default && retarget env && retarget test
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from retarget.cli.commands import CliError, Handler, command
from retarget.launch import command_line
from retarget.launch import launcher as launch
from retarget.launch.config import CONFIG_ENV, LaunchError, config_in_effect, read_settings

#: The script `retarget test` launches.
SANITY_SCRIPT = Path(__file__).with_name("sanity_script.py")


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


@command("config", "write the settings `retarget launch` reads (asks questions; or default)")
def config_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget config [default | --default] [--config_file F]`."""
    parser.add_argument(
        "mode",
        nargs="?",
        choices=["default"],
        help="`retarget config default` is --default (as `accelerate config default`)",
    )
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
    from retarget.launch import questions as config_questions  # imports torch

    with launch_errors():
        default = args.default or args.mode == "default"
        path = config_questions.configure(args.config_file, default=default)
    print(f"wrote {path}")
    return 0


@command("test", "a distributed sanity run: ranks, all_reduce, data shard, a ddp step")
def test_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget test [--num_processes N] [--config_file F]` (as `accelerate test`)."""
    parser.add_argument(
        "--num_processes",
        "--num-processes",
        metavar="N",
        help="processes (default: the config file's, else 2)",
    )
    parser.add_argument("--config_file", "--config-file", metavar="FILE", help="as for launch")
    return run_sanity_test


def run_sanity_test(args: argparse.Namespace) -> int:
    """Launch sanity_script.py as `retarget launch` would; its rank 0 prints the summary."""
    with launch_errors():
        processes = args.num_processes
        if processes is None and config_in_effect(args.config_file) is None:
            processes = "2"
        flags = read_settings({"num_processes": processes}, lambda name: "--num_processes")
        plan = launch.resolve(str(SANITY_SCRIPT), flags=flags, config_file=args.config_file)
    print(launch.describe(plan), file=sys.stderr, flush=True)
    code = launch.run(plan)
    if code:
        print(f"retarget test: failed (exit code {code}); see the rank's error above")
    return code


@command("env", "print versions, devices and the launch config in effect, for bug reports")
def env_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget env [--config_file F]`."""
    parser.add_argument("--config_file", "--config-file", metavar="FILE", help="as for launch")
    return run_env


def run_env(args: argparse.Namespace) -> int:
    """Print the report (torch is imported only here, not for --help)."""
    from retarget.launch import env

    print(env.env_report(args.config_file), end="")
    return 0


@contextlib.contextmanager
def launch_errors() -> Iterator[None]:
    """A bad launch setting, config file or script is a usage error: one line, exit 2."""
    try:
        yield
    except LaunchError as exc:
        raise CliError(str(exc)) from None
