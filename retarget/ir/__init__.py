"""The compiler's IR: the Program that flows through the passes (module tree, regions, plan,
history), and the Regions that hold the captured graphs (one per block type and call
signature), their call keys and the user-hook rules.

Layer: above frontends, core and targets; below execution, passes and runtime. Beside kernels.
"""
