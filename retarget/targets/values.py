"""The one parser of each kind of value a user writes: sizes, booleans, dtypes.

Every reader of user input (the target grammar's options, Accelerate's YAML and environment,
`retarget launch`'s flags, max_memory and max_shard_size, a checkpoint's dtype) parses through
these, and wraps the ValueError in its own error type with the file, key or flag it came from.

    >>> parse_size("1.5GiB"), parse_bool("yes"), parse_dtype("torch.bfloat16")
    (1610612736, True, torch.bfloat16)
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by parse_dtype only: the target language reads without it
    import torch

#: Byte units, largest first (sizes print in the largest exact one): KB/MB/GB/TB are powers of
#: 1000, KiB/MiB/GiB/TiB powers of 1024.
SIZE_UNITS = {"TiB": 2**40, "TB": 10**12, "GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
SIZE_UNITS.update({"KiB": 2**10, "KB": 10**3, "B": 1})
_UNIT_BY_LOWER = {unit.lower(): unit for unit in SIZE_UNITS}
_SIZE = re.compile(
    r"\s*(?P<number>([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*", re.ASCII
)
_BITS = re.compile(r"[KMGT]i?b")
SIZE_HINT = (
    "an int (bytes) or a string such as '500MB', '10GB' (powers of 10) or '2GiB' (powers of 2)"
)

#: Accelerate's `str_to_bool` words, and the ones YAML and our targets write.
TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


class SizeError(ValueError):
    """`value` is not a size; `reason` says why, without naming the value."""

    def __init__(self, what: str, value: Any, reason: str) -> None:
        super().__init__(f"{what}={value!r} {reason}")
        self.reason = reason


def has_size_unit(text: str) -> bool:
    """Whether `text` ends in a byte unit (a size, not a plain number or a fraction)."""
    match = _SIZE.fullmatch(text)
    return match is not None and bool(match["unit"])


def parse_size(value: int | str, *, what: str = "size", minimum: int = 0) -> int:
    """Bytes in `value`: an int, or a number and a unit ("500MB", "1.5GiB", "123" = bytes).

    Units are case-insensitive except that a capital prefix with a lowercase b ("10Mb") is how
    bits are written, and is refused; so are fractions of a byte and sizes under `minimum`.
    Raises ValueError naming `what`.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.fullmatch(str(value)) if isinstance(value, str) else None
        unit = match["unit"] if match else ""
        if match is None or (unit and unit.lower() not in _UNIT_BY_LOWER):
            raise SizeError(what, value, f"is not a size: use {SIZE_HINT}")
        if _BITS.fullmatch(unit):
            raise SizeError(
                what, value, f"is in bits (a lowercase 'b' after {unit[0]}): write {unit[:-1]}B"
            )
        try:
            exact = Decimal(match["number"]) * SIZE_UNITS[_UNIT_BY_LOWER[(unit or "B").lower()]]
        except InvalidOperation:
            raise SizeError(what, value, f"is not a size: use {SIZE_HINT}") from None
        if exact != exact.to_integral_value():
            raise SizeError(what, value, "is not a whole number of bytes")
        size = int(exact)
    if size < minimum:
        least = "more than 0 bytes" if minimum == 1 else f"at least {minimum} bytes"
        raise SizeError(what, value, f"must be {least}")
    return size


def format_size(size: int) -> str:
    """`size` bytes in the largest unit that divides it exactly ("8GiB", "1000001B")."""
    return next(f"{size // n}{u}" for u, n in SIZE_UNITS.items() if size % n == 0)


def parse_bool(value: Any, *, what: str = "value") -> bool:
    """A bool, or one of TRUE_WORDS / FALSE_WORDS (any case); ValueError naming `what`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    raise ValueError(f"{what}: expected true or false, got {value!r}")


def parse_dtype(
    value: str | torch.dtype | None, *, what: str = "dtype", floating: bool = True
) -> torch.dtype | None:
    """A torch dtype from a dtype, "bfloat16", "torch.float16" or "bf16"/"fp16"/"fp32" (None
    stays None). With `floating` (the default) only floating dtypes are accepted."""
    import torch

    if value is None or isinstance(value, torch.dtype):
        parsed = value
    else:
        name = str(value).strip().removeprefix("torch.")
        parsed = getattr(torch, _DTYPE_NAMES.get(name.lower(), name), None)
    if value is not None and (
        not isinstance(parsed, torch.dtype) or (floating and not parsed.is_floating_point)
    ):
        kind = "a floating dtype" if floating else "a dtype"
        raise ValueError(
            f"{what}={value!r} is not {kind} (torch.float32, torch.float16, torch.bfloat16)"
        )
    return parsed
