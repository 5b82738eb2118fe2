"""`from retarget.local_sgd import LocalSGD`: the import path of `accelerate.local_sgd`, so a
script migrates by changing `accelerate` to `retarget` in its import lines. The class lives in
retarget/utils/local_sgd.py (`retarget.utils.LocalSGD`)."""

from retarget.utils.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
