"""retarget: compiler-style rewriting of PyTorch models for training targets.

model = retarget.compile_for(model, target="single", example_inputs=batch)
print(model.report)
"""

from retarget.compile import compile_for
from retarget.compiled import CompiledModule
from retarget.errors import PassError, PassOrderError, TargetNotSupportedError, VerificationError
from retarget.passes.base import Pass, PassResult
from retarget.target import Target, TargetError, parse_target

__version__ = "0.1.0"

__all__ = [
    "CompiledModule",
    "Pass",
    "PassError",
    "PassOrderError",
    "PassResult",
    "Target",
    "TargetError",
    "TargetNotSupportedError",
    "VerificationError",
    "compile_for",
    "parse_target",
]
