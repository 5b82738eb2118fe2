"""Offload at run time: weights live on CPU or in memory-mapped safetensors, and are brought to
the execution device just before the module that owns them runs, then released.

sources.py  where one tensor comes from (a resident CPU tensor, or a file + key on disk)
units.py    which modules get a hook, and which tensors each one brings in
hooks.py    the forward pre/post hooks, tie-preserving swaps, and the prefetch thread
"""
