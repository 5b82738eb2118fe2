"""Accelerate's torch.compile arguments: dynamo_backend=, dynamo_plugin= and ACCELERATE_DYNAMO_*.

As in Accelerate, `Accelerator(dynamo_backend=b)` is `dynamo_plugin=TorchDynamoPlugin(backend=b)`,
passing both is an error, and a plugin's unset fields (and the backend when neither is passed)
come from the variables `accelerate launch` exports: ACCELERATE_DYNAMO_BACKEND, _MODE,
_USE_FULLGRAPH, _USE_DYNAMIC, _USE_REGIONAL_COMPILATION. The plugin becomes the target's compile
part through targets/dynamo_settings.py (the table of what maps to what). A backend passed as an
argument or in a plugin replaces the compile part of a launched target ($RETARGET_TARGET; no
removes it) and must agree with an explicit `target=`, as mixed_precision= does; one read from
the environment alone is used only when the target has no compile part.
Accelerate's own TorchDynamoPlugin instances are read field by field, like ours.

    >>> accelerator = retarget.Accelerator(dynamo_backend="aot_eager")
    >>> str(accelerator.target)
    'single+compile[backend=aot_eager]'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retarget.compat.accelerate.kwargs_base import KwargsHandlerError
from retarget.targets.dynamo_settings import (
    DEFAULT_MODE,
    NO_BACKEND,
    DynamoSettings,
    backend_word,
    with_compile,
)
from retarget.targets.errors import ConfigError
from retarget.targets.grammar import Target, TargetError
from retarget.targets.values import parse_bool

ENV_PREFIX = "ACCELERATE_DYNAMO_"


@dataclass(kw_only=True)
class TorchDynamoPlugin:
    """Accelerate's TorchDynamoPlugin: same fields, defaults and environment variables.

    >>> plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune")
    >>> accelerator = retarget.Accelerator(dynamo_plugin=plugin)
    """

    backend: Any = None
    """A torch.compile backend (no: none); unset: $ACCELERATE_DYNAMO_BACKEND, else no."""
    mode: str | None = None
    """An inductor mode; unset: $ACCELERATE_DYNAMO_MODE, else default."""
    fullgraph: bool | None = None
    """True: a graph break is an error; unset: $ACCELERATE_DYNAMO_USE_FULLGRAPH, else False."""
    dynamic: bool | None = None
    """Symbolic sizes; unset: $ACCELERATE_DYNAMO_USE_DYNAMIC when set, else None (torch decides)."""
    options: Any = None
    """torch.compile's backend options: refused (the compile part has no such option)."""
    disable: bool = False
    """True: no compile part (torch.compile's no-op)."""
    use_regional_compilation: bool | None = None
    """Read for Accelerate's sake; regions are compiled either way (targets/dynamo_settings.py)."""

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in _READ}
        settings = settings_from_environment(os.environ, **given)
        for name in _READ:
            setattr(self, name, getattr(settings, name))


#: The plugin fields that the environment fills and the compile part reads.
_READ = ("backend", "mode", "fullgraph", "dynamic", "use_regional_compilation")


def settings_from_environment(environ: Mapping[str, str], **given: Any) -> DynamoSettings:
    """Accelerate's TorchDynamoPlugin.__post_init__: each field given, else its variable."""

    def field(name: str, variable: str, default: Any, read: Any = None) -> Any:
        if given.get(name) is not None:
            return given[name]
        value = environ.get(ENV_PREFIX + variable)
        if value is None or read is None:
            return default if value is None else value
        return read(ENV_PREFIX + variable, value)

    return DynamoSettings(
        backend=backend_word(field("backend", "BACKEND", NO_BACKEND)),
        mode=field("mode", "MODE", DEFAULT_MODE),
        fullgraph=field("fullgraph", "USE_FULLGRAPH", False, _as_bool),
        dynamic=field("dynamic", "USE_DYNAMIC", None, _as_bool),
        use_regional_compilation=field(
            "use_regional_compilation", "USE_REGIONAL_COMPILATION", False, _as_bool
        ),
    )


def settings_of(plugin: Any) -> DynamoSettings:
    """A TorchDynamoPlugin's (ours or Accelerate's) settings; refuses backend options."""
    missing = [name for name in (*_READ, "options", "disable") if not hasattr(plugin, name)]
    if missing:
        raise TypeError(
            f"dynamo_plugin: {type(plugin).__name__} is not a TorchDynamoPlugin (no "
            f"{', '.join(missing)}); pass retarget.TorchDynamoPlugin or Accelerate's"
        )
    if plugin.options:
        raise KwargsHandlerError(
            f"TorchDynamoPlugin(options={plugin.options!r}) cannot be honoured: the compile "
            "part passes no backend options to torch.compile; drop options, or set them in "
            "torch._inductor.config before prepare"
        )
    if plugin.disable:
        return DynamoSettings()
    return DynamoSettings(
        backend=backend_word(plugin.backend),
        mode=plugin.mode or DEFAULT_MODE,
        fullgraph=bool(plugin.fullgraph),
        dynamic=plugin.dynamic,
        use_regional_compilation=bool(plugin.use_regional_compilation),
    )


def dynamo_target(
    target: Target,
    dynamo_backend: Any = None,
    dynamo_plugin: Any = None,
    *,
    origin: str = "",
    environ: Mapping[str, str] | None = None,
) -> Target:
    """`target` with the compile part the Accelerator's dynamo arguments (or environment) ask.

    An argument replaces the compile part of a launched target (backend no removes it), as
    Accelerate's argument overrides its launch; it must agree with an explicit `target=`
    (origin "target=").
    """
    environ = os.environ if environ is None else environ
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError(
            "Accelerator: pass dynamo_backend= or dynamo_plugin=, not both (as in Accelerate)"
        )
    if dynamo_plugin is not None:
        settings, given = settings_of(dynamo_plugin), "dynamo_plugin"
    elif dynamo_backend is not None:
        settings = settings_from_environment(environ, backend=dynamo_backend)
        given = f"dynamo_backend={dynamo_backend!r}"
    elif "compile" in target:  # target= or $RETARGET_TARGET said it: the environment says less
        return target
    else:
        settings = settings_from_environment(environ)
        return with_compile(target, settings.compile_options()) if settings.compiles else target
    wanted = with_compile(target, settings.compile_options())
    if origin == "target=" and "compile" in target and wanted != target:
        raise TargetError(
            f"target='{target}' says {target.get('compile')} but {given} asks for "
            f"{wanted.get('compile') or 'no compile'}: keep one",
            "compile",
        )
    return wanted


def _as_bool(name: str, value: str) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} is not a boolean; set it to true or false") from None
