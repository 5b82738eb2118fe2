"""The target spec: what a model is rewritten for, as a frozen, validated value.

Grammar::

    target := part ("+" part)*
    part   := name ["[" key=value ("," key=value)* "]"]

Examples: ``"ddp+bf16"``, ``"fsdp[reshard=false]+fp8[backend=te,amax_history=1024]+ac"``,
``"bf16[keep_fp32=softmax|norm]"``, ``"fsdp+ac[budget=8GiB]"``.

- Whitespace around tokens is ignored. Names, option keys and enum values are case-insensitive
  and printed lowercase.
- Values: bools ``true``/``false`` (``yes/no``, ``on/off``, ``1/0`` also read), integers, floats,
  enum words, lists joined by ``|`` (``none`` is the empty list; commas separate options), and
  for ``ac[budget=...]`` a fraction of activation memory in (0, 1] (``0.5``) or a size
  (``512MB``, ``1.5GiB``: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024,
  at least 1MB; printed in the largest unit that divides it exactly).
- ``str(target)`` is canonical: parts in the order of ``PARTS`` (``bf16+ddp == ddp+bf16``),
  option keys sorted, options equal to their default dropped (``ddp[bucket_cap_mb=25] == ddp``).
  ``parse_target(str(t)) == t`` for every valid ``t``.
- A target without a distribution part runs in one process: ``"bf16"`` is single-process bf16.
  ``tp`` alone shards over the whole world with no data parallelism. Related names stay distinct
  (``zero3`` and ``fsdp`` mean the same but compare unequal): the spec keeps what the user wrote.

Every user mistake raises :class:`TargetError` naming the part and the fix, e.g.
``parse_target("fsdpp+bf16")`` -> ``unknown target part 'fsdpp' in 'fsdpp+bf16'; did you mean
'fsdp'?``. The same Target comes from Python (``Target.from_dict``) or from an Accelerate config
YAML (``retarget.target_from_yaml``, in ``retarget/compat/accelerate/config_yaml.py``). The rules
between parts live in ``rules.py``, the part table in ``schema.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from retarget.targets.errors import TargetError, in_where, suggest
from retarget.targets.options import Option, format_option, format_value
from retarget.targets.rules import (
    NAME_HINTS,
    check_conflicts,
    check_option_rules,
    effective_option,
    option_default,
)
from retarget.targets.schema import PART_ORDER, PARTS, PartSchema
from retarget.targets.strategies import STRATEGIES

__all__ = [
    "PARTS",
    "STRATEGIES",
    "Option",
    "Part",
    "PartSchema",
    "Target",
    "TargetError",
    "parse_target",
]


def _coerce_option(name: str, key: str, raw: Any, where: str | None) -> Any:
    opt = PARTS[name].options[key]
    if raw is None and opt.default is None:
        return None
    try:
        return opt.coerce(raw)
    except ValueError as err:
        shown = raw if isinstance(raw, str) else format_value(raw)
        raise TargetError(
            f"bad value {shown!r} for option {key!r} of '{name}'{in_where(where)}: {err}",
            part=where,
        ) from None


def _normalize(name: str, items: Iterable[Any], where: str | None) -> tuple[tuple[str, Any], ...]:
    schema = PARTS[name].options
    values: dict[str, Any] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TargetError(f"options of '{name}' must be (key, value) pairs, got {item!r}", name)
        key = item[0].strip().lower()
        if key not in schema:
            takes = suggest(key, schema) if schema else f"; '{name}' takes no options"
            raise TargetError(f"unknown option {key!r} for '{name}'{in_where(where)}{takes}", where)
        if key in values:
            raise TargetError(f"option {key!r} is given twice{in_where(where)}; keep one", where)
        values[key] = _coerce_option(name, key, item[1], where)
    explicit = {k: v for k, v in values.items() if v != option_default(name, k, values)}
    check_option_rules(name, explicit, where or name)
    return tuple(sorted(explicit.items()))


def _check_name(name: Any, spec: str | None) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a part name must be a str, got {type(name).__name__}")
    word = name.strip().lower()
    if word not in PARTS:
        hint = suggest(word, PARTS, NAME_HINTS)
        raise TargetError(f"unknown target part {word!r}{in_where(spec)}{hint}", part=word)
    return word


@dataclass(frozen=True, repr=False)
class Part:
    """One part of a target: a name from ``PARTS`` and the options set to non-default values.

    ``Part("fp8", {"backend": "TE"})`` is ``fp8[backend=te]``; ``str(part)`` is canonical.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        name = _check_name(self.name, None)
        items = self.options.items() if isinstance(self.options, Mapping) else self.options
        object.__setattr__(self, "name", name)
        object.__setattr__(
            self,
            "options",
            _normalize(name, [tuple(i) if isinstance(i, list) else i for i in items], None),
        )

    def get(self, key: str) -> Any:
        """Option ``key`` as set, or its default: ``Part("ac").get("every") == 1``."""
        if key not in PARTS[self.name].options:
            raise KeyError(f"'{self.name}' has no option {key!r}{suggest(key, self._schema)}")
        return effective_option(self.name, key, dict(self.options))

    def as_dict(self) -> dict[str, Any]:
        """Every option of this part with defaults filled in."""
        return {key: self.get(key) for key in self._schema}

    @property
    def _schema(self) -> Mapping[str, Option]:
        return PARTS[self.name].options

    def __str__(self) -> str:
        if not self.options:
            return self.name
        shown = ",".join(f"{k}={format_option(self._schema[k], v)}" for k, v in self.options)
        return f"{self.name}[{shown}]"

    def __repr__(self) -> str:
        return f"Part({str(self)!r})"


_PART_RE = re.compile(r"([A-Za-z0-9_-]+)\s*(?:\[(.*)\])?", re.ASCII | re.DOTALL)


def _split_parts(spec: str) -> list[str]:
    chunks, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char in "[]":
            depth += 1 if char == "[" else -1
            if depth not in (0, 1):
                what = "nested '['" if depth > 1 else "unmatched ']'"
                raise TargetError(f"{what} in {spec!r}", part=spec[start:].strip())
        elif char == "+" and depth == 0:
            chunks.append(spec[start:i].strip())
            start = i + 1
    if depth:
        chunk = spec[start:].strip()
        raise TargetError(f"unclosed '[' in {chunk!r}; close it with ']'", part=chunk)
    chunks.append(spec[start:].strip())
    if "" in chunks:
        raise TargetError(f"empty part in {spec!r}; remove the extra '+'")
    return chunks


def _malformed(chunk: str) -> str:
    if chunk.startswith("["):
        return f"missing part name before '[' in {chunk!r}"
    if "]" in chunk and not chunk.endswith("]"):
        return f"text after ']' in {chunk!r}; separate parts with '+'"
    return f"bad part {chunk!r}: names use letters, digits, '_' and '-'; separate parts with '+'"


def _parse_options(body: str, where: str) -> list[tuple[str, str]]:
    if not body.strip():
        raise TargetError(f"empty brackets in {where!r}; write key=value or drop them", where)
    items = []
    for item in body.split(","):
        key, equals, value = (text.strip() for text in item.partition("="))
        if not item.strip():
            raise TargetError(f"empty option in {where!r}; remove the stray ','", where)
        if not equals:
            raise TargetError(f"option {key!r} in {where!r} needs a value: {key}=<value>", where)
        if not key:
            raise TargetError(f"missing option name before '=' in {where!r}", where)
        if not value:
            raise TargetError(f"option {key!r} in {where!r} has no value after '='", where)
        items.append((key, value))
    return items


def _parse_part(chunk: str, spec: str) -> Part:
    match = _PART_RE.fullmatch(chunk)
    if match is None:
        raise TargetError(_malformed(chunk), part=chunk)
    name = _check_name(match[1], spec if spec.strip() != chunk else None)
    items = [] if match[2] is None else _parse_options(match[2], chunk)
    return Part(name, _normalize(name, items, chunk))


def _check_unique(names: list[str], spec: str | None) -> None:
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice:
        raise TargetError(
            f"part '{twice}' appears twice{in_where(spec)}; write it once with all its options",
            twice,
        )


@dataclass(frozen=True, repr=False)
class Target:
    """A validated training target: parts in canonical order, e.g. ``Target.parse("ddp+bf16")``.

    ``str(target)`` is the canonical spec; ``"bf16" in target``; ``target.get("fp8")``.
    """

    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if not parts:
            raise TargetError("empty target; write e.g. 'single', 'ddp+bf16' or 'fsdp+fp8'")
        if not all(isinstance(part, Part) for part in parts):
            raise TypeError("Target.parts must be Part objects; use Target.parse for strings")
        _check_unique([part.name for part in parts], None)
        parts = tuple(sorted(parts, key=lambda part: PART_ORDER[part.name]))
        check_conflicts(parts)
        object.__setattr__(self, "parts", parts)

    @classmethod
    def parse(cls, spec: str) -> Target:
        """Parse a spec such as ``"fsdp[reshard=false]+bf16"``; raises TargetError."""
        if not isinstance(spec, str):
            raise TypeError(f"a target spec must be a str, got {type(spec).__name__}")
        if not spec.strip():
            raise TargetError("empty target spec; write e.g. 'single', 'ddp+bf16' or 'fsdp+fp8'")
        chunks = _split_parts(spec)
        parts = [_parse_part(chunk, spec) for chunk in chunks]
        _check_unique([part.name for part in parts], spec.strip())
        return cls(tuple(parts))

    @classmethod
    def from_dict(cls, parts: Mapping[str, Mapping[str, Any] | None]) -> Target:
        """Build from ``{"fsdp": {"reshard": False}, "bf16": None}``; values as in a spec."""
        return cls(tuple(Part(name, dict(options or {})) for name, options in parts.items()))

    @property
    def names(self) -> tuple[str, ...]:
        """Part names in canonical order."""
        return tuple(part.name for part in self.parts)

    @property
    def strategy(self) -> str:
        """The distribution part's name, or ``"single"`` when there is none."""
        return next((name for name in self.names if name in STRATEGIES), "single")

    def get(self, name: str) -> Part | None:
        """The part called ``name``, or None when the target does not have it."""
        name = _known_name(name)
        return next((part for part in self.parts if part.name == name), None)

    def has(self, name: str) -> bool:
        """Whether the target has a part called ``name`` (a KeyError for unknown names)."""
        return self.get(name) is not None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def __str__(self) -> str:
        return "+".join(str(part) for part in self.parts)

    def __repr__(self) -> str:
        return f"Target({str(self)!r})"


def _known_name(name: str) -> str:
    word = name.strip().lower()
    if word not in PARTS:
        raise KeyError(f"unknown target part {word!r}{suggest(word, PARTS, NAME_HINTS)}")
    return word


def parse_target(spec: str | Target) -> Target:
    """``parse_target("bf16+ddp")`` -> ``Target('ddp+bf16')``; a Target passes through."""
    return spec if isinstance(spec, Target) else Target.parse(spec)
