"""set_seed: one seed for Python's, NumPy's and torch's generators (every device's)."""

from __future__ import annotations

import random

import numpy as np
import torch

from retarget.execution.process import ProcessState


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed `random`, NumPy and torch (CPU and every CUDA device) with `seed`.

    `device_specific=True` adds the process index, so each rank draws differently (dropout
    masks, augmentations); `deterministic=True` also turns on
    `torch.use_deterministic_algorithms`, as Accelerate does.

        >>> set_seed(42)
        >>> set_seed(42, device_specific=True)     # rank r is seeded with 42 + r
    """
    if device_specific:
        seed += ProcessState.current().rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
