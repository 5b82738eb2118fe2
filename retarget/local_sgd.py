"""`from retarget.local_sgd import LocalSGD`: the import path of `accelerate.local_sgd`, so a
script migrates by changing `accelerate` to `retarget` in its import lines. The class lives in
retarget/compat/accelerate/utils/local_sgd.py (`retarget.compat.accelerate.utils.LocalSGD`)."""

from retarget.compat.accelerate.utils.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
