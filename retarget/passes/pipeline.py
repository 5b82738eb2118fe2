"""Target -> ordered pass list. One line per stage, in the order they run, with why.

Each stage looks at the target and contributes zero or more passes. The PassManager re-derives
the order from each pass's `requires`; this list is the default order where the declarations
leave a choice, and the place to read what a target turns into. A target part that no stage
handles is refused (TargetNotSupportedError), never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable

from retarget.errors import TargetNotSupportedError
from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.base import Pass
from retarget.passes.capture.capture_regions import CaptureOptions, CaptureRegions
from retarget.target import Target

Stage = Callable[[Target, CaptureOptions], list[Pass]]

#: (parts the stage realises, stage), in pipeline order.
STAGES: list[tuple[frozenset[str], Stage]] = [
    # The tree and the repeated blocks decide what becomes a region.
    (frozenset(), lambda target, capture: [FindBlocks()]),
    # One graph per block type, before any graph rewrite.
    (frozenset(), lambda target, capture: [CaptureRegions(capture)]),
    # Shapes and FLOPs of the model as given, for the report and for later decisions.
    (frozenset(), lambda target, capture: [AnnotateShapes()]),
    # One process, nothing to distribute: the parts above are the whole pipeline.
    (frozenset({"single"}), lambda target, capture: []),
]


def build_pipeline(
    target: Target, *, capture: str = "regions", frontends: tuple[str, ...] | None = None
) -> list[Pass]:
    """The passes that realise `target`, in default order; refuses parts no stage handles."""
    handled = frozenset().union(*(parts for parts, _ in STAGES))
    unsupported = [name for name in target.names if name not in handled]
    if unsupported:
        missing = ", ".join(repr(n) for n in unsupported)
        raise TargetNotSupportedError(
            f"target '{target}': no pass implements {missing} yet; refusing rather than "
            f"silently ignoring it (supported: {', '.join(sorted(handled))})"
        )
    options = CaptureOptions(mode=capture, **({"frontends": frontends} if frontends else {}))
    return [p for _, stage in STAGES for p in stage(target, options)]
