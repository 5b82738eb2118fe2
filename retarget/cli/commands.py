"""The subcommand registry of the `retarget` command and what every subcommand uses.

Each subcommand is one function registered with `@command`: it adds its arguments to the
parser it is given and returns the handler that runs it (`Namespace -> exit code`). Handlers
raise `CliError` for user mistakes: `main` prints its one-line message and returns its exit
code (2, like argparse's own usage errors).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from retarget.core.errors import PassError, TargetNotSupportedError
from retarget.targets.grammar import Target, TargetError, parse_target

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


def parse_target_arg(spec: str) -> Target:
    """A --target spec; a bad one is a CliError with the grammar's message."""
    try:
        return parse_target(spec)
    except TargetError as exc:
        raise CliError(str(exc)) from None


@contextlib.contextmanager
def compile_errors() -> Iterator[None]:
    """Report compile_for's refusals as one line: an unsupported target part, a failed pass."""
    try:
        yield
    except TargetNotSupportedError as exc:
        raise CliError(str(exc)) from None
    except PassError as exc:  # not a usage error: the message names the pass that failed
        raise CliError(str(exc), code=1) from None


def require_graphviz() -> None:
    """Fail fast, as a CliError, when svg output is asked for and graphviz is missing."""
    from retarget.report import render

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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default, unless its help already says it or there is none
    to show (None: taken from elsewhere, a config file say; False: a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not text:
            return text
        return f"{text} (default: %(default)s)"
