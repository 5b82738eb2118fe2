"""Kernels and modules the passes swap in (FP8 Linears, their recipes and layout rules). Torch
only: nothing here imports a pass, the IR or the runtime."""
