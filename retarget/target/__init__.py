"""The target language: grammar (`grammar.py`), the part table and its rules (`schema.py`), and
Accelerate's config YAML read as a target (`accelerate_yaml.py`). The lowest layer."""

from retarget.target.grammar import Part, Target, TargetError, parse_target
from retarget.target.schema import PARTS, STRATEGIES

__all__ = ["PARTS", "STRATEGIES", "Part", "Target", "TargetError", "parse_target"]
