"""Target -> ordered pass list. One line per pass, in the order they run, with why.

The PassManager re-derives the order from each pass's `requires`; this list is the default order
where the declarations leave a choice, and the place to read what a target turns into.
"""

from __future__ import annotations

from retarget.errors import TargetNotSupportedError
from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.base import Pass
from retarget.passes.capture.capture_regions import CaptureOptions, CaptureRegions
from retarget.target import Target

#: Target parts that every pipeline honours without a pass of their own.
NO_PASS_NEEDED = frozenset({"single"})


def build_pipeline(
    target: Target, *, capture: str = "regions", frontends: tuple[str, ...] | None = None
) -> list[Pass]:
    """The passes that realise `target`, in default order; refuses parts with no pass yet."""
    unsupported = [name for name in target.names if name not in NO_PASS_NEEDED]
    if unsupported:
        raise TargetNotSupportedError(
            f"target '{target}': no pass implements {', '.join(repr(n) for n in unsupported)} "
            "yet; refusing rather than silently ignoring it (supported today: single)"
        )
    options = CaptureOptions(mode=capture, **({"frontends": frontends} if frontends else {}))
    return [
        FindBlocks(),  # first: the tree and the repeated blocks decide what becomes a region
        CaptureRegions(options),  # one graph per block type, before any graph rewrite
        AnnotateShapes(),  # shapes/FLOPs over the captured program, for the report and later passes
    ]
