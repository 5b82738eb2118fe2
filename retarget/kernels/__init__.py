"""Kernels and modules the passes swap in (FP8 Linears, their recipes and layout rules).

Layer: torch only, beside the IR: nothing here imports a pass, the IR, the execution layer or
the runtime (core for slots and errors only).
"""
