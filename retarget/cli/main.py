"""The `retarget` command line (also `python -m retarget`).

    retarget inspect tests.zoo:tiny_llama --inputs tests.zoo:lm_inputs --target single --format html
    retarget inspect mypkg.models:build --target single --format svg --out model.svg
    retarget demo --steps 20
    retarget launch --num_processes 2 --mixed_precision bf16 train.py --lr 3e-4
    retarget config --default && retarget env

Each subcommand is one function registered with `@command`: it adds its arguments to the
parser it is given and returns the handler that runs it (`Namespace -> exit code`). Adding a
subcommand is adding one such function. Handlers raise `CliError` for user mistakes: `main`
prints its one-line message and returns its exit code (2, like argparse's own usage errors).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import retarget
from retarget.core.errors import PassError, TargetNotSupportedError
from retarget.launch import env
from retarget.launch import launcher as launch
from retarget.launch import questions as config_questions
from retarget.launch.config import CONFIG_ENV, LaunchError
from retarget.passes.capture.capture_regions import MODES as CAPTURE_MODES
from retarget.report import render
from retarget.target.grammar import TargetError, parse_target

Handler = Callable[[argparse.Namespace], int]
Registrar = Callable[[argparse.ArgumentParser], Handler]

#: Subcommand name -> (one-line help, function that adds its arguments and returns its handler).
COMMANDS: dict[str, tuple[str, Registrar]] = {}
_SPEC_FORM = "expected 'package.module:function', e.g. tests.zoo:tiny_llama"
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class CliError(Exception):
    """A mistake on the command line: printed as one line, exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def command(name: str, help: str) -> Callable[[Registrar], Registrar]:
    """Register a subcommand: the decorated function adds its arguments and returns its handler.

    >>> @command("hello", "print a greeting")
    ... def hello_arguments(parser):
    ...     parser.add_argument("--name", default="world")
    ...     return lambda args: print(f"hello {args.name}") or 0
    """

    def register(add_arguments: Registrar) -> Registrar:
        COMMANDS[name] = (help, add_arguments)
        return add_arguments

    return register


def build_parser() -> argparse.ArgumentParser:
    """The `retarget` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="retarget", description="Compiler-style rewriting of PyTorch models for targets."
    )
    version = f"retarget {retarget.__version__} (torch {torch.__version__})"
    parser.add_argument("--version", action="version", version=version)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments) in COMMANDS.items():
        sub = subcommands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=add_arguments(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    try:
        return args.handler(args)
    except CliError as exc:
        print(f"retarget {args.command}: error: {exc}", file=sys.stderr)
        return exc.code


# ------------------------------------------------------------------------- inspect
@command("inspect", "capture a model for a target and show what each pass did")
def inspect_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget inspect PKG.MODULE:FACTORY --target T [...]`."""
    parser.add_argument(
        "factory", metavar="PKG.MODULE:FACTORY", help="function returning the model (no args)"
    )
    parser.add_argument("--target", default="single", help="target spec, e.g. single (default)")
    parser.add_argument(
        "--inputs",
        metavar="PKG.MODULE:FN",
        help="function returning example inputs: tuple = args, dict = kwargs, else one argument; "
        "without it regions are captured at their first call, so no graphs are shown",
    )
    parser.add_argument(
        "--capture",
        choices=CAPTURE_MODES,
        default="regions",
        help="one graph per repeated block (default), the whole model, or none",
    )
    parser.add_argument(
        "--format",
        choices=render.FORMATS,
        default="text",
        help="svg needs graphviz; html inlines the svg when graphviz is installed",
    )
    parser.add_argument("--out", metavar="PATH", help="write to PATH instead of stdout")
    parser.add_argument(
        "--world-size",
        type=positive_int,
        help="processes a ddp/fsdp plan is made for (default: this run's world size, else 1)",
    )
    parser.add_argument(
        "--max-nodes",
        type=positive_int,
        default=render.GRAPH_NODE_CAP,
        help="graph nodes drawn per region (dot, svg, html); the rest fold into one node",
    )
    return run_inspect


def run_inspect(args: argparse.Namespace) -> int:
    """Build the model, compile it for the target and write the report in the chosen format."""
    target = _parse_target(args.target)
    if args.format == "svg":
        _require_graphviz()  # before the model is built: fail fast
    factory = load_callable(args.factory, "factory")
    make_inputs = load_callable(args.inputs, "inputs") if args.inputs else None
    model = factory()
    if not isinstance(model, nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, not nn.Module")
    example = make_inputs() if make_inputs else None
    with _compile_errors():
        compiled = retarget.compile_for(
            model,
            target,
            example_inputs=example,
            capture=args.capture,
            world_size=args.world_size,
        )
    try:
        text = render.render(compiled.program, args.format, max_nodes=args.max_nodes)
    except render.GraphvizError as exc:
        raise CliError(str(exc)) from None
    write_output(text, args.out)
    return 0


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Import `package.module:name` (or `:Class.method`), the current directory first on the path.

    The current directory goes first on `sys.path`, as uvicorn does, so `tests.zoo:tiny_llama`
    works from a checkout. A missing module or attribute is a CliError naming the expected form;
    a module that exists but fails to import raises as is (its traceback is what to fix).
    """
    module_name, _, attribute = spec.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attribute):
        raise CliError(f"{what} {spec!r} is malformed: {_SPEC_FORM}")
    cwd = os.getcwd()
    if sys.path[:1] != [cwd]:
        sys.path.insert(0, cwd)
    try:
        found: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
            raise  # the module exists; something it imports is missing
        raise CliError(f"{what} {spec!r}: no module named {exc.name!r}; {_SPEC_FORM}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            close = difflib.get_close_matches(part, dir(found), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            owner = getattr(found, "__name__", module_name)
            raise CliError(
                f"{what} {spec!r}: {owner!r} has no attribute {part!r}{hint}; {_SPEC_FORM}"
            )
        found = getattr(found, part)
    if not callable(found):
        kind = type(found).__name__
        raise CliError(f"{what} {spec!r} is not callable (a {kind}); {_SPEC_FORM}")
    return found


def write_output(text: str, out: str | None) -> None:
    """Write `text` to the file `out` (printing its path) or to stdout."""
    if out is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")


def _parse_target(spec: str) -> retarget.Target:
    try:
        return parse_target(spec)
    except TargetError as exc:
        raise CliError(str(exc)) from None


@contextlib.contextmanager
def _compile_errors() -> Iterator[None]:
    """Report compile_for's refusals as one line: an unsupported target part, a failed pass."""
    try:
        yield
    except TargetNotSupportedError as exc:
        raise CliError(str(exc)) from None
    except PassError as exc:  # not a usage error: the message names the pass that failed
        raise CliError(str(exc), code=1) from None


def _require_graphviz() -> None:
    try:
        render.require_graphviz()
    except render.GraphvizNotFound as exc:
        raise CliError(str(exc)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ------------------------------------------------------------------------- demo
@command("demo", "train the built-in tiny transformer for a few steps, compiled for a target")
def demo_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget demo [--target T] [--steps N] [--batch B] [--seq S] [--capture MODE]`."""
    parser.add_argument("--target", default="single", help="target spec (default: single)")
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per batch")
    parser.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    parser.add_argument(
        "--capture", choices=CAPTURE_MODES, default="regions", help="as for inspect"
    )
    return run_demo_command


def run_demo_command(args: argparse.Namespace) -> int:
    """Train TinyLM for `--steps`, then print the report and the first and last loss."""
    from retarget.cli import demo
    from retarget.models import TinyConfig

    target = _parse_target(args.target)
    longest = TinyConfig().max_seq
    if not 2 <= args.seq <= longest:  # one token has no next token to predict
        raise CliError(f"--seq must be between 2 and {longest} (TinyLM's rotary tables)")
    with _compile_errors():
        result = demo.run_demo(
            target=target, steps=args.steps, batch=args.batch, seq=args.seq, capture=args.capture
        )
    print(result.compiled.report)
    print()
    print(result.summary())
    return 0


# ------------------------------------------------------------------------- estimate-memory
@command("estimate-memory", "predict a training step's memory per rank for a target")
def estimate_memory_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget estimate-memory PKG.MODULE:FACTORY --target T [--inputs FN] [...]`."""
    from retarget.report.memory_estimate import OPTIMIZERS

    parser.add_argument(
        "factory", metavar="PKG.MODULE:FACTORY", help="function returning the model (no args)"
    )
    parser.add_argument("--target", default="single", help="target spec, e.g. fsdp+bf16+ac")
    parser.add_argument(
        "--inputs",
        metavar="PKG.MODULE:FN",
        help="function returning one rank's example batch (as for inspect); without it "
        "activations are unknown",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        help="ranks the target shards over (default: this run's world size, else 1)",
    )
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    return run_estimate_memory


def run_estimate_memory(args: argparse.Namespace) -> int:
    """Compile the target's local parts here, profile one forward, print the per-rank table."""
    from retarget.driver.estimate import estimate_for_target

    target = _parse_target(args.target)
    model = load_callable(args.factory, "factory")()
    if not isinstance(model, nn.Module):
        raise CliError(f"factory {args.factory!r} returned {type(model).__name__}, not nn.Module")
    example = load_callable(args.inputs, "inputs")() if args.inputs else None
    with _compile_errors():
        estimate = estimate_for_target(
            model, target, example, world_size=args.world_size, optimizer=args.optimizer
        )
    text = json.dumps(estimate.to_dict(), indent=2) if args.format == "json" else str(estimate)
    write_output(text, None)
    return 0


# ------------------------------------------------------------------------- launch, config, env
@command("launch", "run a training script on N processes (torchrun underneath)")
def launch_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget launch [--num_processes N] [...] script.py [script args]` (Accelerate's flags)."""
    launch.add_arguments(parser)
    return run_launch


def run_launch(args: argparse.Namespace) -> int:
    """Decide the launch (a bad setting stops here, exit 2), say what runs, run it."""
    with _launch_errors():
        plan = launch.plan_from_args(args)
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
    with _launch_errors():
        path = config_questions.configure(args.config_file, default=args.default)
    print(f"wrote {path}")
    return 0


@command("env", "print versions, devices and the launch config in effect, for bug reports")
def env_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget env [--config_file F]`."""
    parser.add_argument("--config_file", "--config-file", metavar="FILE", help="as for launch")
    return lambda args: print(env.env_report(args.config_file), end="") or 0


@command("bench", "run the benchmark suite (bench/) and print its ratios as one table")
def bench_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget bench [--quick] [SUITE ...] [--write-readme] [--plot PNG] [--no-run]`."""
    from retarget.cli import bench

    parser.add_argument("suites", nargs="*", metavar="SUITE", help=", ".join(bench.SUITES))
    parser.add_argument("--quick", action="store_true", help="a small subset, fewer rounds")
    parser.add_argument(
        "--no-run", action="store_true", help="only read and show the figures last written"
    )
    parser.add_argument(
        "--write-readme", action="store_true", help="write the table into bench/README.md"
    )
    parser.add_argument("--plot", metavar="PNG", help="plot the ratios (needs matplotlib)")

    def handle(args: argparse.Namespace) -> int:
        try:
            where = bench.bench_dir()
            suites = bench.select(args.suites, args.quick)
            status = {} if args.no_run else bench.run_suites(suites, quick=args.quick, bench=where)
            # Every suite's last figures: running one suite refreshes its rows, not the table.
            rows = bench.collect(list(bench.SUITES.values()), where)
            print(bench.table(rows))
            if args.write_readme:
                bench.write_readme(rows, where / "README.md")
                print(f"wrote the table into {where / 'README.md'}")
            if args.plot:
                bench.plot(rows, Path(args.plot))
                print(f"wrote {args.plot}")
        except bench.BenchError as exc:
            raise CliError(str(exc)) from None
        return 0 if all(v == "ok" or v.startswith("skipped") for v in status.values()) else 1

    return handle


@contextlib.contextmanager
def _launch_errors() -> Iterator[None]:
    """A bad launch setting, config file or script is a usage error: one line, exit 2."""
    try:
        yield
    except LaunchError as exc:
        raise CliError(str(exc)) from None
