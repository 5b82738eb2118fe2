"""The random number generator states of this process: Python, NumPy, torch CPU and the device
(an accelerator's generator, and the XLA device's running seed when this process runs XLA).

A resumed run repeats an uninterrupted one bit for bit only if every generator the training
step draws from continues where it stopped: dropout masks (torch CPU, or the accelerator's
generator for tensors on it), data augmentation (Python's `random`, NumPy's global generator)
and sampler seeds. Each rank has its own states (ranks usually seed differently so their dropout
masks differ), so a checkpoint keeps one `RngState` per rank.

    >>> state = RngState.capture()
    >>> a = torch.rand(2)
    >>> state.restore()
    >>> torch.equal(torch.rand(2), a)
    True

`to_tree()` is plain data and tensors only (see `state_codec`), so it is saved without pickle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retarget.execution import xla_device as xla


def _accelerator() -> torch.device | None:
    """This process's accelerator device (CUDA, XPU, ...), None on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return None
    device = torch.accelerator.current_accelerator()
    return torch.device(device.type, torch.accelerator.current_device_index())


@dataclass(frozen=True, kw_only=True)
class RngState:
    """The generator states of one process, captured together."""

    python: tuple
    """`random.getstate()`: (version, 625 Mersenne Twister words, cached gauss or None)."""
    numpy: dict[str, Any]
    """NumPy's global generator as `np.random.get_state(legacy=False)`, the key as ints."""
    torch_cpu: torch.Tensor
    """`torch.get_rng_state()`: the CPU generator (dropout on CPU tensors, randperm, ...)."""
    device: str | None = None
    """The accelerator whose generator is in `device_state` ("cuda:0"), None without one."""
    device_state: torch.Tensor | None = None
    """That accelerator's generator state (dropout on its tensors)."""
    xla_seed: int | None = None
    """The XLA device's running seed (dropout on XLA tensors), None when XLA did not run."""

    @classmethod
    def capture(cls) -> RngState:
        """The current states of every generator this process draws from."""
        np_state = np.random.get_state(legacy=False)
        numpy = {
            "bit_generator": np_state["bit_generator"],
            "key": [int(w) for w in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
        device = _accelerator()
        device_state = None
        if device is not None:
            device_state = torch.get_device_module(device.type).get_rng_state(device)
        return cls(
            python=random.getstate(),
            numpy=numpy,
            torch_cpu=torch.get_rng_state(),
            device=None if device is None else str(device),
            device_state=device_state,
            xla_seed=xla.rng_seed(),
        )

    def restore(self) -> None:
        """Put every generator back to this state.

        A state captured with an accelerator cannot be restored without one (the device's
        dropout masks could not be repeated): that is an error. A state captured on a CPU-only
        machine leaves an accelerator's generator where it is. The same holds for the XLA seed.
        """
        if self.xla_seed is not None:
            xla.torch_xla_or_refuse()  # before anything is restored: the XLA stream is saved
        device = _accelerator()
        if self.device is not None and device is None:
            raise RuntimeError(
                f"the saved RNG state includes the generator of {self.device}, but this process "
                "has no accelerator: resume on the same kind of machine"
            )
        version, words, gauss = self.python
        random.setstate((version, tuple(words), gauss))
        np.random.set_state(
            {
                "bit_generator": self.numpy["bit_generator"],
                "state": {
                    "key": np.asarray(self.numpy["key"], dtype=np.uint32),
                    "pos": self.numpy["pos"],
                },
                "has_gauss": self.numpy["has_gauss"],
                "gauss": self.numpy["gauss"],
            }
        )
        torch.set_rng_state(self.torch_cpu)
        if self.device_state is not None:
            torch.get_device_module(device.type).set_rng_state(self.device_state, device)
        if self.xla_seed is not None:
            xla.set_rng_seed(self.xla_seed)

    def to_tree(self) -> dict[str, Any]:
        """Plain data and tensors, for `state_codec`."""
        return {
            "python": self.python,
            "numpy": self.numpy,
            "torch_cpu": self.torch_cpu,
            "device": self.device,
            "device_state": self.device_state,
            "xla_seed": self.xla_seed,
        }

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> RngState:
        """The state `to_tree` described."""
        return cls(**tree)
