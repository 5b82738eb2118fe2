"""Make Hugging Face code take, while we trace it, the path it takes when it runs eagerly.

Some HF functions ask `is_torchdynamo_compiling()` (true inside any torch tracer, export included)
to avoid code that breaks a torch.compile graph. Where both paths trace fine under a non-strict
export but compute differently, a graph of the traced path cannot be bit-for-bit equal to eager,
and the eager check rightly rejects it. Measured (transformers 5.23): sdpa attention with grouped
key/value heads, one query token and a mask (a decode step under a sliding window) packs the
query heads eagerly (`pack_gqa`) but repeats the key/value heads when traced; the outputs differ
by about 4e-9. While a frontend traces, `eager_paths()` answers "not compiling" to those modules
only, and only if the program already imported them (retarget never imports transformers).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

#: Modules whose `is_torchdynamo_compiling` guards only a choice between two traceable paths.
EAGER_PATH_MODULES = ("transformers.integrations.sdpa_attention",)


def _not_compiling() -> bool:
    return False


@contextlib.contextmanager
def eager_paths() -> Iterator[None]:
    """While tracing, the listed HF modules take their eager path."""
    patched = []
    for name in EAGER_PATH_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "is_torchdynamo_compiling"):
            patched.append((module, module.is_torchdynamo_compiling))
            module.is_torchdynamo_compiling = _not_compiling
    try:
        yield
    finally:
        for module, original in patched:
            module.is_torchdynamo_compiling = original


__all__ = ["EAGER_PATH_MODULES", "eager_paths"]
