"""`from retarget.inference import prepare_pippy`: the import path of `accelerate.inference`, so
a script migrates by changing `accelerate` to `retarget` in its import lines. The function lives
in retarget/compat/accelerate/pippy.py."""

from retarget.compat.accelerate.pippy import prepare_pippy

__all__ = ["prepare_pippy"]
