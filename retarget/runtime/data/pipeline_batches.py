"""Batches a pipeline can run: under pp every batch has the rows its stages were traced for.

torch's pipeline stages receive each microbatch into buffers sized from the trace (the example
inputs cut into `microbatches` pieces), so a batch of any other size cannot run. A prepared
loader under pp is checked when it is prepared, not at the step that would fail: a batch size
other than the traced one is refused, naming both; an epoch whose last batch would be short
(the dataset not a multiple of the batch) drops that batch, as `drop_last=True` does, with a
warning that says how many samples each epoch leaves out.
"""

from __future__ import annotations

import warnings
from typing import Any

from retarget.core.plans import PpPlan


def fit_to_pipeline(loader: Any, plan: PpPlan) -> None:
    """Check `loader` (a ShardedDataLoader) against the pipeline's batch rows, and have it drop
    an incomplete last batch."""
    rows = plan.microbatch_rows * plan.microbatches
    if loader.batch_size is None:
        return  # the loader does not batch: forward_backward checks each batch
    where = f"pp[microbatches={plan.microbatches}]"
    if loader.batch_size != rows:
        raise ValueError(
            f"{where}: the stages were traced for batches of {rows} rows ({plan.microbatch_rows} "
            f"per microbatch, from example_inputs), and this loader gives {loader.batch_size} "
            f"rows per batch on each data-parallel rank: use batch_size={rows} per rank, or "
            f"compile_for with an example batch of {loader.batch_size} rows"
        )
    if loader.drop_last:
        return
    total = loader.total_dataset_length
    left = total % (rows * loader.state.world_size) if total is not None else None
    loader.drop_incomplete_batches()
    if left != 0:
        count = "some" if left is None else str(left)
        warnings.warn(
            f"{where}: every batch must have the {rows} rows the stages were traced for, so "
            f"the last, incomplete batch of each epoch ({count} samples) is dropped, as "
            "drop_last=True would; use a dataset size that is a multiple of the batch to "
            "train on every sample",
            stacklevel=3,
        )
