"""The `retarget` command line (also `python -m retarget`).

    retarget inspect tests.zoo:tiny_llama --inputs tests.zoo:lm_inputs --target single --format html
    retarget inspect mypkg.models:build --target single --format svg --out model.svg
    retarget demo --steps 20

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
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import retarget
from retarget import render
from retarget.errors import PassError, TargetNotSupportedError
from retarget.passes.capture.capture_regions import MODES as CAPTURE_MODES
from retarget.target import TargetError, parse_target

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
        compiled = retarget.compile_for(model, target, example_inputs=example, capture=args.capture)
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
    from retarget import demo
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
