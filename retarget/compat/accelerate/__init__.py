"""Hugging Face Accelerate's API over the compiler: `Accelerator` (accelerator.py and its
parity_*/state_/step_methods), Accelerate's kwargs handlers and plugins mapped onto targets
(target_choice.py, *_kwargs.py, dynamo.py), trackers, `accelerate.utils` (utils/), Accelerate's
config YAML and launch sections read as targets (config_*.py), its checkpoint folders
(checkpoint_folder.py, checkpoint_restore.py) and its batch order (data_order.py).

It may import every compiler layer (driver, runtime, passes, spec, ...); none of them imports it.
Users reach it as `retarget.Accelerator`, `retarget.utils` and `retarget.local_sgd`.
"""
