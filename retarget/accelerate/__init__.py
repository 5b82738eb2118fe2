"""The Accelerate front door: `retarget.Accelerator`, Accelerate's kwargs handlers, plugins
and trackers, mapped onto targets, `compile_for` and the runtime. Nothing below imports it."""
