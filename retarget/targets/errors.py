"""The errors of user configuration (ConfigError) and of the target language (raised by the
grammar, its rules and the config readers), and how their messages name the offending word."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class ConfigError(ValueError):
    """Something the user wrote (a target spec, a config file, a launch flag) cannot be used:
    the message names the file, key or word and the fix. Every reader of user configuration
    raises a subclass of it, never a traceback from deep inside."""


class TargetError(ConfigError):
    """A target spec or config the user wrote is invalid; ``part`` names the offending part."""

    def __init__(self, message: str, part: str | None = None) -> None:
        super().__init__(message)
        self.part = part


def suggest(word: str, choices: Iterable[str], hints: Mapping[str, str] | None = None) -> str:
    """The end of an "unknown word" message: the close choice (``hints`` first), or them all.

    ``suggest("fsdpp", PARTS)`` -> ``"; did you mean 'fsdp'?"``.
    """
    choices = list(choices)
    close = [hints[word]] if hints and word in hints else []
    close = close or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of: {', '.join(choices)}"


def in_where(where: str | None) -> str:
    """`` in 'fsdp[x=1]'`` naming the spec or part a message is about; empty when unknown."""
    return f" in {where!r}" if where else ""
