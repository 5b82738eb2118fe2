"""The compiler's passes: one pass per file, grouped by family (analysis/, capture/,
precision/, memory/, compile/, shard/, comm/, place/, apply/), run by the PassManager
(`manager.py`) in the one order of `pipeline.py` (STAGES); `base.py` is the pass contract and
`facts.py` what each `provides` token means.

Passes decide: they capture and rewrite graphs and record plans; the appliers (apply/) carry
the plans out through the execution layer. Layer: beside runtime; above execution, ir,
kernels, frontends, core and targets; below bigmodel, report and the driver.
"""
