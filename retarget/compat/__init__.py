"""Compatibility layers: other libraries' APIs, written over the compiler.

`compat/accelerate/` is Hugging Face Accelerate's surface (the Accelerator, its kwargs handlers,
plugins and trackers, `accelerate.utils`, its config YAML, checkpoint folders and batch order).
This layer sits above the compiler (driver, report, bigmodel, runtime, passes and everything
below them), which imports nothing from it; only `launch`, `cli` and the import-path aliases
(`retarget.utils`, `retarget.local_sgd`, names on `retarget` itself) import it.
"""
