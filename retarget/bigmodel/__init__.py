"""Big-model inference, the user's side: build a model without its weights
(`init_empty_weights`), load a checkpoint into it (memory-mapped or tensor by tensor), and
dispatch it along a device map (`dispatch_model`, `cpu_offload`, `disk_offload`).

Layer: above runtime and passes (it plans maps with passes/place and hooks offloaded weights
through execution/offload); below the driver. Nothing in the compiler imports it.
"""
