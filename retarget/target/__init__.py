"""The target language, the lowest layer: the part table (`schema.py`), option values
(`options.py`), the rules between parts (`rules.py`), the grammar (`grammar.py`), and
Accelerate's config YAML read as a target (`accelerate_yaml.py`, which needs PyYAML and is
imported only by what reads such files)."""

from retarget.target.grammar import Part, Target, TargetError, parse_target
from retarget.target.schema import PARTS
from retarget.target.strategies import STRATEGIES

__all__ = ["PARTS", "STRATEGIES", "Part", "Target", "TargetError", "parse_target"]
