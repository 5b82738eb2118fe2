"""The `retarget` command line (also `python -m retarget`).

    retarget inspect tests.zoo:tiny_llama --inputs tests.zoo:lm_inputs --target single --format html
    retarget inspect mypkg.models:build --target single --format svg --out model.svg
    retarget demo --steps 20
    retarget launch --num_processes 2 --mixed_precision bf16 train.py --lr 3e-4
    retarget config --default && retarget env

The subcommands register themselves with `@command` (cli/commands.py) in their group's module;
COMMAND_GROUPS lists the modules, and so the order of `--help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

import retarget
from retarget.cli.commands import COMMANDS, CliError, DefaultsHelpFormatter

#: The modules whose `@command` functions make the subcommands, in the order `--help` shows.
COMMAND_GROUPS = (
    "retarget.cli.model_commands",  # inspect, demo, estimate-memory
    "retarget.cli.launch_commands",  # launch, config, env
    "retarget.cli.bench",  # bench
    "retarget.cli.bigmodel_commands",  # device-map
    "retarget.cli.checkpoint_commands",  # convert-checkpoint
)


def build_parser() -> argparse.ArgumentParser:
    """The `retarget` parser with every registered subcommand."""
    for group in COMMAND_GROUPS:
        importlib.import_module(group)
    parser = argparse.ArgumentParser(
        prog="retarget", description="Compiler-style rewriting of PyTorch models for targets."
    )
    # torch's version from its metadata: importing torch would cost seconds on every --help
    version = f"retarget {retarget.__version__} (torch {metadata.version('torch')})"
    parser.add_argument("--version", action="version", version=version)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments) in COMMANDS.items():
        # Every option's --help line shows its default.
        sub = subcommands.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=DefaultsHelpFormatter,
        )
        sub.set_defaults(handler=add_arguments(sub), parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the command's own usage, not the top-level one, says what it takes
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse exits for --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    try:
        return args.handler(args)
    except CliError as exc:
        print(f"retarget {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
