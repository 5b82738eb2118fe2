"""`retarget launch --dynamo_*`: Accelerate's torch.compile flags as the target's compile part.

    retarget launch --num_processes 2 --dynamo_backend inductor train.py
    # target ddp+compile[backend=inductor,dynamic=false], exported as RETARGET_TARGET

The flags are Accelerate's: --dynamo_backend (no: no compile part), --dynamo_mode,
--dynamo_use_fullgraph, --dynamo_use_dynamic, --dynamo_use_regional_compilation (also with
dashes). They change the target in effect (from --target, the config file, or the default) and
override its compile part key by key; targets/dynamo_settings.py says what maps to what. As under
`accelerate launch`, which always exports ACCELERATE_DYNAMO_USE_DYNAMIC, a backend without
--dynamo_use_dynamic compiles with dynamic=false, unless the target's compile part already says.
A mode or a switch without a backend (and without a compile part to change) is refused, and so is
one beside --dynamo_backend no. What each flag sets is the table of targets/dynamo_settings.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from retarget.launch.config import LaunchError
from retarget.targets.dynamo_settings import DEFAULT_MODE, backend_word, with_compile
from retarget.targets.grammar import Target

#: flag -> (metavar or None for a switch, help).
_FLAGS = {
    "dynamo_backend": ("BACKEND", "torch.compile backend: inductor, aot_eager, eager, ... or no"),
    "dynamo_mode": ("MODE", "inductor mode: default, reduce-overhead, max-autotune, ..."),
    "dynamo_use_fullgraph": (None, "a graph break is an error (compile[fullgraph=true])"),
    "dynamo_use_dynamic": (None, "symbolic sizes from the start (compile[dynamic=true])"),
    "dynamo_use_regional_compilation": (None, "compile the repeated blocks (always done)"),
}


@dataclass(frozen=True, kw_only=True)
class DynamoFlags:
    """The --dynamo_* flags given; None for each one absent."""

    dynamo_backend: str | None = None
    dynamo_mode: str | None = None
    dynamo_use_fullgraph: bool | None = None
    dynamo_use_dynamic: bool | None = None
    dynamo_use_regional_compilation: bool | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> DynamoFlags:
        return cls(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    def given(self) -> list[str]:
        """The flags given, as spelled on the command line."""
        return [f"--{f.name}" for f in fields(self) if getattr(self, f.name) is not None]


def add_dynamo_arguments(parser: argparse.ArgumentParser) -> None:
    """The five --dynamo_* flags (each also with dashes)."""
    for name, (metavar, help_text) in _FLAGS.items():
        names = (f"--{name}", f"--{name.replace('_', '-')}")
        if metavar is None:
            parser.add_argument(
                *names, dest=name, action="store_true", default=None, help=help_text
            )
        else:
            parser.add_argument(*names, dest=name, metavar=metavar, help=help_text)


def with_dynamo_flags(target: Target, origin: str, flags: DynamoFlags | None) -> tuple[Target, str]:
    """The target in effect and its origin, with the flags' compile part; raises LaunchError."""
    given = [] if flags is None else flags.given()
    if not given:
        return target, origin
    assert flags is not None
    return _compile_part(target, flags, given), f"{origin} with {' '.join(given)}"


def _compile_part(target: Target, flags: DynamoFlags, given: list[str]) -> Target:
    backend = flags.dynamo_backend
    others = [flag for flag in given if flag != "--dynamo_backend"]
    if backend is not None and backend.strip().lower() == "no":
        if others:
            raise LaunchError(
                f"{', '.join(others)} given with --dynamo_backend no, which compiles nothing; "
                "drop them or name a backend (e.g. --dynamo_backend inductor)"
            )
        return with_compile(target, None)
    part = target.get("compile")
    if backend is None and part is None:
        raise LaunchError(
            f"{', '.join(others)} changes torch.compile, but nothing is compiled: add "
            f"--dynamo_backend (e.g. inductor), or a compile part to the target ({target})"
        )
    options = dict(part.options) if part is not None else {"dynamic": False}
    if backend is not None:
        options["backend"] = backend_word(backend)
    if flags.dynamo_mode is not None:
        options.pop("mode", None)
        if flags.dynamo_mode != DEFAULT_MODE:
            options["mode"] = flags.dynamo_mode
    switches = {
        "fullgraph": flags.dynamo_use_fullgraph,
        "dynamic": flags.dynamo_use_dynamic,
        "scope": "regions" if flags.dynamo_use_regional_compilation else None,
    }
    options.update({key: value for key, value in switches.items() if value is not None})
    return with_compile(target, options)
