"""Memory passes: checkpoint_blocks (`ac`: full, selective, every=N, budget), with its
activation profile, budget solver and the selective graph rewrite; the checkpoint wrappers that
run at step time are the execution layer's (execution/checkpoint.py, kept_calls.py)."""
