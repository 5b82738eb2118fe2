"""The execution layer: everything that runs at step time, carrying out what the passes decided.

- module_call.py: `RetargetedModule`, the one class through which a module's calls run as its
  record says (checkpoint, autocast, the region's graph, its own forward);
- autocast.py, checkpoint.py, kept_calls.py, graph_checkpoint.py, recompute_rules.py: the
  precision and activation-checkpointing wrappers;
- compiled_calls.py, flat_calls.py: the compiled runners compile_regions installs;
- process.py, apply_plan.py, apply_tp.py, tp_fsdp.py, comm_hooks.py, step_guard.py: the
  process group, and DDP / FSDP2 / tensor parallel applied to the model, the optimizer guard;
- pipeline_stages.py: pipeline parallelism: this rank's stage of torch's split and its schedule;
- context/: context parallelism: the split attention ops, transformers' attention interface
  routed to them, the batch split and the whole loss, the (dp, cp) mesh applied;
- xla_device.py, xla_placement.py: torch-xla behind one import probe, the model on XLA devices;
- offload/, stream.py, nested.py: weights brought in per block, tensors moved in nested data.

Layer: below passes and runtime (they decide and drive; this executes); above ir, kernels,
frontends, core and targets. It imports no pass, no runtime module and nothing above them.
"""
