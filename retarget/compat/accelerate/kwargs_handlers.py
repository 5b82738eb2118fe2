"""Accelerate's kwargs handlers, each mapped onto the target or a runtime setting, with every
field we cannot honour refused by name.

    >>> handler = DistributedDataParallelKwargs(comm_hook="bf16")
    >>> Accelerator(kwargs_handlers=[handler])          # 2 processes: target ddp+bf16-comm

The classes keep Accelerate's names, fields and defaults, so a script passes the same objects
(Accelerate's own instances are converted by `as_handler`). Only fields that differ from their
default act, as in Accelerate. Where each field goes: precision_kwargs.py (GradScalerKwargs,
the FP8 recipes, AutocastKwargs) and process_kwargs.py (DistributedDataParallelKwargs,
InitProcessGroupKwargs, ProfileKwargs) say, one table each. This module is their registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from retarget.compat.accelerate.kwargs_base import KwargsHandler, KwargsHandlerError
from retarget.compat.accelerate.precision_kwargs import (
    FP8_RECIPES,
    AORecipeKwargs,
    AutocastKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from retarget.compat.accelerate.process_kwargs import (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

__all__ = ["HANDLERS", "as_handler", "collect_handlers"]


#: Our handler classes by name: Accelerate's instances of the same names are converted.
HANDLERS: dict[str, type[KwargsHandler]] = {
    cls.__name__: cls
    for cls in (
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        TERecipeKwargs,
        MSAMPRecipeKwargs,
        AORecipeKwargs,
        FP8RecipeKwargs,
        InitProcessGroupKwargs,
        AutocastKwargs,
        ProfileKwargs,
    )
}


def as_handler(obj: Any) -> KwargsHandler:
    """Our handler for `obj` (ours, or Accelerate's instance of the same name, converted)."""
    if isinstance(obj, KwargsHandler):
        return obj
    name = type(obj).__name__
    if name not in HANDLERS:
        raise KwargsHandlerError(
            f"kwargs_handlers holds a {name}, which retarget does not know: it takes "
            f"{', '.join(HANDLERS)}"
        )
    cls = HANDLERS[name]
    known = {f.name for f in fields(cls)}
    given = _changed_fields(obj)
    unknown = sorted(set(given) - known)
    if unknown:
        raise KwargsHandlerError(
            f"{name}({', '.join(unknown)}) cannot be honoured: retarget's {name} has no such "
            f"field (it takes {', '.join(sorted(known))})"
        )
    return cls(**given)


def _changed_fields(obj: Any) -> dict[str, Any]:
    """A foreign handler's fields that differ from its own class's defaults (what it asks for).

    Accelerate passes on only those (its default InitProcessGroupKwargs backend "nccl" never
    reaches torch), so a default is left to ours.
    """
    if not dataclasses.is_dataclass(obj):
        return dict(vars(obj))
    try:
        default = type(obj)()
    except Exception:  # noqa: BLE001 - a class without defaults: every field is asked for
        default = None
    return {
        f.name: getattr(obj, f.name)
        for f in fields(obj)
        if default is None or getattr(obj, f.name) != getattr(default, f.name)
    }


def collect_handlers(kwargs_handlers: Any) -> dict[type[KwargsHandler], KwargsHandler]:
    """`kwargs_handlers` by class; a class given twice is an error, as in Accelerate."""
    found: dict[type[KwargsHandler], KwargsHandler] = {}
    for obj in kwargs_handlers or ():
        handler = as_handler(obj)
        if type(handler) in found:
            raise KwargsHandlerError(
                f"kwargs_handlers holds two {type(handler).__name__}: merge them into one"
            )
        found[type(handler)] = handler
    recipes = [h for h in found.values() if isinstance(h, FP8_RECIPES)]
    if len(recipes) > 1:
        names = ", ".join(type(h).__name__ for h in recipes)
        raise KwargsHandlerError(f"kwargs_handlers holds several FP8 recipes ({names}): keep one")
    return found
