"""Where each disk-offloaded tensor can be memory-mapped from: a safetensors file and a key.

The loader (`retarget.bigmodel.load_checkpoint`) does not load tensors of modules a device map
sends to "disk": it records a `DiskWeight` per tensor name instead, pointing into the checkpoint
itself when the stored tensor is already what the model wants, or into a file it wrote under
`offload_folder` (after a dtype cast, or from a .bin checkpoint). The offload runtime opens them
with `safetensors.safe_open` just before the block runs. The records travel on the model (slot
`DISK_WEIGHTS`) and, when there is an offload folder, in its `disk_index.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

INDEX_NAME = "disk_index.json"


@dataclass(frozen=True)
class DiskWeight:
    """One offloaded tensor: `safe_open(file).get_tensor(key)` gives it, in `dtype`/`shape`."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.torch_dtype).element_size()


def write_disk_index(folder: str | Path, weights: dict[str, DiskWeight]) -> Path:
    """Write `folder/disk_index.json`: tensor name -> {file, key, dtype, shape}."""
    path = Path(folder) / INDEX_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: asdict(w) for k, w in weights.items()}, indent=1) + "\n")
    return path


def read_disk_index(folder: str | Path) -> dict[str, DiskWeight]:
    """The records `write_disk_index` wrote (files as absolute paths)."""
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {folder} is not an offload folder")
    raw = json.loads(path.read_text())
    return {
        name: DiskWeight(file=r["file"], key=r["key"], dtype=r["dtype"], shape=tuple(r["shape"]))
        for name, r in raw.items()
    }
