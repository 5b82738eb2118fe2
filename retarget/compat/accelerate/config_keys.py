"""How one key of an Accelerate config is read: value converters and key handlers.

A section of the config is a table of handlers, one per key (config_sections.py holds the
tables): a handler sets an option of the part the key belongs to (``sets_option``), adds a part
(``adds_part``), accepts what describes what we do anyway (``accepted``), or refuses anything
but a no-op value with the reason (``refused_unless``). ``apply_keys`` runs a section's table.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from retarget.targets.errors import TargetError
from retarget.targets.schema import PARTS
from retarget.targets.values import parse_bool


@dataclass(frozen=True)
class AccelerateFile:
    """An Accelerate config mapping and where it came from, which every message names."""

    data: Mapping[str, Any]
    source: str

    def fail(self, key: str, problem: str) -> NoReturn:
        """Raise TargetError: ``<source>: <key>: <problem>``."""
        raise TargetError(f"{self.source}: {key}: {problem}", part=key)


#: The target being read: ``{part: {option: value}}``, given to Target.from_dict at the end.
Parts = dict[str, dict[str, Any]]
#: A handler reads one key: (file, key path, value, parts being built, the part it belongs to).
Handler = Callable[[AccelerateFile, str, Any, Parts, str], None]
#: A converter reads one value (file, key path, value) or fails naming the key.
Convert = Callable[[AccelerateFile, str, Any], Any]
#: Values that ask for nothing: a key holding one may be accepted though we do not act on it.
NOOPS = (None, False, "", "no", "none", [], {})


def is_noop(value: Any, extra: tuple[Any, ...] = ()) -> bool:
    """Whether ``value`` (or every item of a non-empty mapping or list) is a no-op value."""
    if isinstance(value, str):
        value = value.strip().lower()
        extra = tuple(e.lower() if isinstance(e, str) else e for e in extra)
    if isinstance(value, (dict, list)) and value:
        items = value.values() if isinstance(value, dict) else value
        return all(is_noop(item) for item in items)
    return any(value == noop and type(value) is type(noop) for noop in (*NOOPS, *extra))


def as_bool(file: AccelerateFile, key: str, value: Any) -> bool:
    """A YAML bool, or true/yes/false/no (targets/values.py's words) as text."""
    try:
        return parse_bool(value)
    except ValueError:
        file.fail(key, f"expected true or false, got {value!r}")


def as_int(file: AccelerateFile, key: str, value: Any, low: int = 0) -> int:
    """An integer (or its digits as text) of at least ``low``."""
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip(), re.ASCII):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        file.fail(key, f"expected an integer, got {value!r}")
    if value < low:
        file.fail(key, f"must be >= {low}, got {value}")
    return value


def as_text(file: AccelerateFile, key: str, value: Any) -> str | None:
    """A string (an int read as its digits), stripped; None stays None."""
    if value is None or isinstance(value, (str, int)) and not isinstance(value, bool):
        return None if value is None else str(value).strip()
    return file.fail(key, f"expected a string, got {value!r}")


def upper_word(value: Any) -> str:
    """``value`` as an uppercase word, the way Accelerate writes enum values."""
    # Unquoted NO is YAML 1.1's false: `distributed_type: NO` means the word.
    return "NO" if value is False else str(value).strip().upper()


def word_map(table: Mapping[str, Any]) -> Convert:
    """A converter from the words of ``table`` (case-insensitive; ints read as their digits)."""

    def convert(file: AccelerateFile, key: str, value: Any) -> Any:
        word = upper_word(value)
        if word not in table:
            close = difflib.get_close_matches(word, list(table), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            file.fail(key, f"{value!r} is not one of {', '.join(table)}{hint}")
        return table[word]

    return convert


def read_elsewhere(file: AccelerateFile, key: str, value: Any, parts: Parts, home: str) -> None:
    """The key is read by the function that owns its section."""


def sets_option(option: str, convert: Convert) -> Handler:
    """The key sets ``option`` of the part it belongs to."""

    def handle(file: AccelerateFile, key: str, value: Any, parts: Parts, home: str) -> None:
        value = convert(file, key, value)
        spec = PARTS[home].options.get(option)
        if spec is None:
            default = next(p.options[option].default for p in PARTS.values() if option in p.options)
            if value != default:
                file.fail(key, f"{value!r} has no meaning for '{home}'; remove it")
            return
        try:
            parts[home][option] = spec.coerce(value)
        except ValueError as err:
            file.fail(key, f"bad value {value!r}: {err}")

    return handle


def adds_part(part: str) -> Handler:
    """The key is a bool that adds ``part`` to the target."""

    def handle(file: AccelerateFile, key: str, value: Any, parts: Parts, home: str) -> None:
        if as_bool(file, key, value):
            parts.setdefault(part, {})

    return handle


def accepted(convert: Convert) -> Handler:
    """The key is accepted with any valid value: it describes what we do anyway."""

    def handle(file: AccelerateFile, key: str, value: Any, parts: Parts, home: str) -> None:
        convert(file, key, value)

    return handle


def refused_unless(*values: Any, why: str) -> Handler:
    """The key is accepted only with a no-op value (or one of ``values``); else refused."""

    def handle(file: AccelerateFile, key: str, value: Any, parts: Parts, home: str) -> None:
        if not is_noop(value, values):
            file.fail(key, f"{value!r} cannot be honoured: {why}")

    return handle


def apply_keys(
    file: AccelerateFile,
    section: str,
    config: Mapping[str, Any],
    keys: Mapping[str, Handler],
    parts: Parts,
    home: str,
) -> None:
    """Run the handler of every key of ``config`` (keys named ``<section><key>``); an unknown
    key fails before any is read."""
    for key in config:
        if key not in keys:
            close = difflib.get_close_matches(str(key), list(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            file.fail(f"{section}{key}", f"unknown key{hint}")
    for key, value in config.items():
        keys[key](file, f"{section}{key}", value, parts, home)


def read_section(file: AccelerateFile, key: str) -> Mapping[str, Any]:
    """The mapping under top-level ``key`` (empty when absent)."""
    value = file.data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        file.fail(key, f"expected a mapping, got {value!r}")
    return value
