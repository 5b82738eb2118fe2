"""The one precision table: each precision word, the target parts it stands for, its dtype.

`--mixed_precision`, Accelerate's `mixed_precision=`, config files and the passes all read it.

    >>> PRECISION_PARTS["fp8"]
    ('bf16', 'fp8')
    >>> LOW_DTYPES["bf16"]
    torch.bfloat16
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from retarget.targets.grammar import Part, Target

if TYPE_CHECKING:
    import torch

#: The mixed-precision words, Accelerate's spelling ("no" = full precision).
MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")
#: word -> the target parts it means (fp8 runs the ops that stay unquantised in bf16).
PRECISION_PARTS: dict[str, tuple[str, ...]] = {
    "no": (),
    "bf16": ("bf16",),
    "fp16": ("fp16",),
    "fp8": ("bf16", "fp8"),
}


class _LowDtypes(Mapping[str, "torch.dtype"]):
    """{"bf16": torch.bfloat16, "fp16": torch.float16}, torch imported at the first lookup
    (the launcher and `--help` read the precision words without torch)."""

    _NAMES = {"bf16": "bfloat16", "fp16": "float16"}

    def __getitem__(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, self._NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)

    def __repr__(self) -> str:
        return repr(dict(self))


#: precision part -> the dtype its autocast regions compute in.
LOW_DTYPES: Mapping[str, torch.dtype] = _LowDtypes()
#: Parts that set a precision.
PRECISION_PART_NAMES = ("bf16", "fp16", "fp8")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how plans and reports spell a dtype."""
    return str(dtype).removeprefix("torch.")


def precision_of(target: Target) -> str | None:
    """The mixed_precision word a target states (None when it names no precision part)."""
    names = {name for name in target.names if name in PRECISION_PART_NAMES}
    if not names:
        return None
    return "fp8" if "fp8" in names else names.pop()


def low_dtype(target: Target) -> torch.dtype | None:
    """The autocast dtype the target computes in (None in full precision)."""
    return next((LOW_DTYPES[name] for name in target.names if name in LOW_DTYPES), None)


def with_precision(target: Target, mixed_precision: str) -> Target:
    """`target` with its precision parts replaced by `mixed_precision`'s (kept when it agrees).

    ``with_precision(Target.parse("fsdp+fp16"), "bf16")`` -> ``fsdp+bf16``; ``"no"`` drops them.
    """
    if precision_of(target) == (None if mixed_precision == "no" else mixed_precision):
        return target
    kept = [part for part in target.parts if part.name not in PRECISION_PART_NAMES]
    kept += [Part(name) for name in PRECISION_PARTS[mixed_precision]]
    return Target(tuple(kept or [Part("single")]))
