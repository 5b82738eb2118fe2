"""The training loop's side of a compiled model (`compiled.runtime`): data sharded over the
processes (`data/`), collectives and gather_for_metrics, backward with the loss scaler,
accumulation, clipping, prepared optimizers, checkpoints and save_model (`state/`), preemption.

Layer: beside passes (neither imports the other); above the execution layer, which it uses for
the process group and what apply_plan applied; below bigmodel, report and the driver.
"""
