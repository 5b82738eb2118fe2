"""Distribution passes: decide how the model is replicated or sharded, record it in the plan.

They run before any process group exists (`retarget inspect --target fsdp` in one process shows
the plan); `retarget.execution.apply_plan` applies what they recorded when compile_for runs under a
process group of more than one process.
"""
