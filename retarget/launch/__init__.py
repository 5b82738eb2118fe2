"""`retarget launch`: settings from flags and config files (ours and Accelerate's, through
compat/accelerate), the config questions, the torchrun launcher and the per-rank worker, the
environment report.

Layer: above compat and the compiler; below cli.
"""
