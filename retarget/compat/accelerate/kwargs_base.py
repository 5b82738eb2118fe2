"""What every kwargs handler shares: the base class, its error, and the target being drafted.

A handler maps Accelerate's fields onto the target (`shape_target`, which edits a
`TargetDraft`) or onto a runtime setting; a field it cannot honour is refused by name
(`refuse`). The handlers are in precision_kwargs.py and process_kwargs.py; kwargs_handlers.py
converts Accelerate's instances and collects them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from retarget.targets.strategies import STRATEGIES

__all__ = ["KwargsHandler", "KwargsHandlerError", "TargetDraft"]


class KwargsHandlerError(ValueError):
    """A kwargs handler field cannot be honoured; the message names the field and the way out."""


@dataclass
class TargetDraft:
    """The target being assembled from an Accelerator's arguments: `{part: {option: value}}`."""

    parts: dict[str, dict[str, Any]]
    strategy_is_default: bool
    """The distribution part came from the world size, not from the user (so DDP settings may
    turn `single` into `ddp`: in a world of one the plan is recorded, and reported as unapplied)."""

    @property
    def strategy(self) -> str:
        return next((name for name in self.parts if name in STRATEGIES), "single")

    def set_option(self, part: str, option: str, value: Any, who: str) -> None:
        """Set `part[option]`, refusing a different value the target already gives it."""
        options = self.parts.setdefault(part, {})
        if option in options and options[option] != value:
            raise KwargsHandlerError(
                f"{who} sets {part}[{option}={value}] but the target says "
                f"{part}[{option}={options[option]}]: keep one of them"
            )
        options[option] = value


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True, kw_only=True)
class KwargsHandler:
    """Base of the handlers: only fields that differ from their default act (as in Accelerate)."""

    def changed(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != _default(f)
        }

    def refuse(self, name: str, why: str) -> NoReturn:
        """Raise KwargsHandlerError: field `name` (with its value) cannot be honoured, and why."""
        raise KwargsHandlerError(
            f"{type(self).__name__}({name}={getattr(self, name)!r}) cannot be honoured: {why}"
        )

    def shape_target(self, draft: TargetDraft) -> None:
        """Contribute to the target (handlers that map onto it override this)."""

    def fp8_config(self) -> dict[str, Any]:
        """Accelerate `fp8_config` keys this handler stands for (FP8 recipe handlers)."""
        return {}
