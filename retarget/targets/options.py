"""A target option: its kind, default and bounds, how its value is read from spec text or
Python, and how it is printed back (``parse_target(str(t)) == t`` rests on the two agreeing).

Reading is a table keyed by the option's kind (bool, int, float, enum, name, list, bools,
budget), so a new kind is one converter and one table row.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from retarget.targets.values import SizeError, format_size, has_size_unit, parse_bool, parse_size


@dataclass(frozen=True)
class Option:
    """One option of a part. ``kind`` is bool, int, float, enum, name, ref, list, bools or
    budget."""

    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    strict: bool = False  # bounds are exclusive
    length: int | None = None  # fixed length of a "bools" list

    def coerce(self, value: Any) -> Any:
        """``value`` (spec text or a Python value) in canonical form; ValueError says why not."""
        return _COERCE[self.kind](self, value)


def bool_option(default: bool, doc: str) -> Option:
    """A true/false option: ``bool_option(True, "pin the CPU copies")``."""
    return Option("bool", default, doc)


def int_option(default: int, doc: str, low: int = 0) -> Option:
    """An integer option of at least ``low``."""
    return Option("int", default, doc, low=low)


def float_option(
    default: float, doc: str, low: float, high: float | None = None, strict: bool = True
) -> Option:
    """A finite number between ``low`` and ``high`` (bounds exclusive when ``strict``)."""
    return Option("float", default, doc, low=low, high=high, strict=strict)


def enum_option(default: str, choices: str, doc: str) -> Option:
    """One word of ``choices`` (joined by ``|``): ``enum_option("full", "full|sharded", ...)``."""
    return Option("enum", default, doc, tuple(choices.split("|")))


def ref_option(default: str, choices: str, doc: str) -> Option:
    """One word of ``choices`` or a ``PKG.MODULE:NAME`` reference to a Python object (its case
    kept): ``ref_option("auto", "auto|hf", "how layers are split")``."""
    return Option("ref", default, doc, tuple(choices.split("|")))


def list_option(default: str, choices: str, doc: str) -> Option:
    """Words joined by ``|`` (from ``choices`` when given, else fnmatch patterns), sorted."""
    chosen = tuple(sorted(default.split("|"))) if default else ()
    return Option("list", chosen, doc, tuple(choices.split("|")) if choices else ())


#: The smallest size budget accepted; a share below it is written as a fraction.
MIN_BUDGET_BYTES = 10**6


_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?", re.ASCII | re.I)
_NAME_VALUE_RE = re.compile(r"[a-z0-9_.:-]+", re.ASCII)
_REF_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_PATTERN_RE = re.compile(r"[A-Za-z0-9_.*?]+", re.ASCII)


def _to_bool(opt: Option, value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError("expected true or false") from None


def _check_range(opt: Option, value: float) -> None:
    op = ">" if opt.strict else ">="
    if opt.low is not None and (value < opt.low or (opt.strict and value == opt.low)):
        raise ValueError(f"must be {op} {opt.low:g}")
    if opt.high is not None and (value > opt.high or (opt.strict and value == opt.high)):
        raise ValueError(f"must be {op.replace('>', '<')} {opt.high:g}")


def _to_int(opt: Option, value: Any) -> int:
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected an integer")
    _check_range(opt, value)
    return value


def _to_float(opt: Option, value: Any) -> float:
    if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError("expected a finite number")
    _check_range(opt, value)
    return float(value)


def _to_enum(opt: Option, value: Any) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    word = value.strip().lower() if isinstance(value, str) else ""
    if word in opt.choices:
        return word
    close = difflib.get_close_matches(word, opt.choices, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"expected one of {', '.join(opt.choices)}{hint}")


def _to_name(opt: Option, value: Any) -> str:
    if isinstance(value, str) and _NAME_VALUE_RE.fullmatch(value.strip().lower()):
        return value.strip().lower()
    raise ValueError("expected a name of letters, digits, '_', '.', ':' or '-'")


def _to_ref(opt: Option, value: Any) -> str:
    if isinstance(value, str) and _REF_RE.fullmatch(value.strip()):
        return value.strip()
    try:
        return _to_enum(opt, value)
    except ValueError as exc:
        raise ValueError(f"{exc} (or a reference PKG.MODULE:NAME)") from None


def _to_list(opt: Option, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [] if value.strip().lower() == "none" else value.split("|")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError("expected items joined by '|', or none")
    words = [_list_item(opt, item) for item in items]
    twice = sorted({word for word in words if words.count(word) > 1})
    if twice:
        raise ValueError(f"{twice[0]!r} is listed twice")
    return tuple(sorted(words))


def _list_item(opt: Option, item: Any) -> str:
    if not isinstance(item, str) or not item.strip():
        raise ValueError("list items must be non-empty words joined by '|'")
    if opt.choices:
        return _to_enum(opt, item)
    if item.strip().lower() == "none":
        raise ValueError("'none' stands for the empty list and cannot be an item")
    if not _PATTERN_RE.fullmatch(item.strip()):
        raise ValueError(f"bad pattern {item.strip()!r}: use letters, digits, '_', '.', '*', '?'")
    return item.strip()


def _to_bools(opt: Option, value: Any) -> tuple[bool, ...]:
    items = value.split("|") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != opt.length:
        raise ValueError(f"expected {opt.length} bools joined by '|', e.g. false|false|true")
    return tuple(_to_bool(opt, item) for item in items)


def _to_budget(opt: Option, value: Any) -> float | int | None:
    wrong = "expected a fraction in (0, 1] like 0.5, or a size like 8GiB or 512MB"
    if isinstance(value, str):
        text = value.strip()
        if has_size_unit(text):
            try:
                value = parse_size(text)
            except SizeError as error:
                if error.reason.startswith("is not a size"):
                    raise ValueError(wrong) from None
                raise ValueError(f"{text} {error.reason}") from None
        else:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(wrong) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(wrong)
    if isinstance(value, int) and value < MIN_BUDGET_BYTES:
        raise ValueError("a size budget must be at least 1MB; use a fraction for a share")
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError("a fraction must be in (0, 1]; add a unit for a size, e.g. 8GiB")
    return value


_COERCE = {
    "bool": _to_bool,
    "int": _to_int,
    "float": _to_float,
    "enum": _to_enum,
    "name": _to_name,
    "ref": _to_ref,
    "list": _to_list,
    "bools": _to_bools,
    "budget": _to_budget,
}


def format_value(value: Any) -> str:
    """A Python option value as spec text: ``true``, ``a|b`` (``none`` when empty), ``0.5``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "|".join(format_value(item) for item in value) or "none"
    return repr(value) if isinstance(value, float) else str(value)


def format_option(opt: Option, value: Any) -> str:
    """``value`` of ``opt`` as spec text; a size budget in its largest exact unit (``8GiB``)."""
    if opt.kind == "budget" and isinstance(value, int):
        return format_size(value)
    return format_value(value)
