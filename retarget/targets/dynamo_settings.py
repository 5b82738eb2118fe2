"""Accelerate's torch.compile settings as the options of the target's `compile` part.

One mapping for the doors that are not a config file: `Accelerator(dynamo_backend=...)`,
`Accelerator(dynamo_plugin=TorchDynamoPlugin(...))`, the `ACCELERATE_DYNAMO_*` variables
`accelerate launch` exports, and `retarget launch --dynamo_*` (a config file's `dynamo_config`
is read by compat/accelerate/config_sections.py, key by key, into the same options):

    backend                    no -> no compile part | else backend=<lowercase>
    mode                       default -> (default)  | else mode=<mode>
    fullgraph                  fullgraph=true|false
    dynamic                    None -> dynamic=auto  | True, False -> dynamic=true|false
    use_regional_compilation   True, False -> scope=regions (the default)

Accelerate compiles the whole model with torch.compile when use_regional_compilation is False,
its default, so False cannot say "whole model" here without refusing every model that is not one
graph (an HF decoder with its cache): both values compile regions, which trains to the same
numbers; write `compile[scope=whole]` for the whole model.

    >>> DynamoSettings(backend="INDUCTOR", mode="max-autotune").compile_options()
    {'backend': 'inductor', 'mode': 'max-autotune', 'fullgraph': False}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retarget.targets.grammar import Target

NO_BACKEND = "no"
DEFAULT_MODE = "default"


@dataclass(frozen=True, kw_only=True)
class DynamoSettings:
    backend: str = NO_BACKEND
    """A torch.compile backend name in any case (Accelerate's DynamoBackend value), or no."""
    mode: str = DEFAULT_MODE
    """An inductor mode; default leaves the compile part's default."""
    fullgraph: bool = False
    """True: a graph break is an error."""
    dynamic: bool | None = None
    """None: torch decides after a size changes (auto); True/False: symbolic sizes or never."""
    use_regional_compilation: bool = False
    """Read, but both values compile regions (module docstring)."""

    @property
    def compiles(self) -> bool:
        return backend_word(self.backend) != NO_BACKEND

    def compile_options(self) -> dict[str, Any] | None:
        """The compile part's options; None when the backend is no."""
        if not self.compiles:
            return None
        options: dict[str, Any] = {"backend": backend_word(self.backend)}
        if self.mode not in (None, DEFAULT_MODE):
            options["mode"] = self.mode
        options["fullgraph"] = bool(self.fullgraph)
        if self.dynamic is not None:
            options["dynamic"] = bool(self.dynamic)
        if self.use_regional_compilation:
            options["scope"] = "regions"
        return options


def backend_word(backend: Any) -> str:
    """A backend as the compile part spells it: an enum's value or a name, lowercase."""
    return str(getattr(backend, "value", backend)).strip().lower()


def with_compile(target: Target, options: dict[str, Any] | None) -> Target:
    """`target` with its compile part replaced by one with `options`; None removes the part."""
    parts = {p.name: dict(p.options) for p in target.parts if p.name != "compile"}
    if options is not None:
        parts["compile"] = options
    return Target.from_dict(parts)
