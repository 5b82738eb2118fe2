"""The target language: the part table (`schema.py`), option values (`options.py`), the rules
between parts (`rules.py`), the grammar (`grammar.py`), the strategy and precision tables, and
the one parser of sizes, booleans and dtypes users write (`values.py`).

Layer: the lowest but the built-in models; it imports nothing else from retarget. Accelerate's
config YAML, read as a target, is the compat layer's (compat/accelerate/config_yaml.py).
"""

from retarget.targets.grammar import Part, Target, TargetError, parse_target
from retarget.targets.schema import PARTS
from retarget.targets.strategies import STRATEGIES

__all__ = ["PARTS", "STRATEGIES", "Part", "Target", "TargetError", "parse_target"]
