"""Appliers: the last stages of the pipeline, which carry out what the passes recorded.

Each is a thin pass over an execution-layer function: apply_plan (DDP, FSDP2, tensor parallel
on the process group, the optimizer step guard), apply_xla (the model on the XLA devices),
apply_stream (offloaded blocks' weights hooked in). They decide nothing; they run after every
decision, so they see the modules and parameters as the passes left them. The PassManager
records them like any pass but does not re-run the model after them: a distributed model's
forward is collective, and XLA's is lazy.
"""
