"""Core: the vocabulary every layer shares: errors, module-tree helpers (structural copies,
with_mixin), the per-module record and the slots retarget keeps in a module's __dict__, the
capture context, the world a plan is made for, the typed plan records, device-map and
disk-weight records.

Layer: above the target language (targets/) and the built-in models only; imports nothing else
from retarget.
"""
