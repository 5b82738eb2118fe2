"""Where an offloaded tensor comes from, and how it is brought to the execution device.

A `CpuSource` holds a resident CPU tensor: on a CPU execution device it is used as is (no
copy); elsewhere it is copied there. A `DiskSource` names a tensor in a safetensors file:
- on a CPU execution device, in the dtype it is stored in, the tensor is used straight from the
  file's memory map (`safe_open(...).get_tensor` maps, it does not read): no copy, and its pages
  are file pages the kernel may drop, never anonymous memory. Prefetching it asks the kernel
  to read its byte range now (posix_fadvise WILLNEED, which returns at once): by the time the
  block runs its pages are in the page cache and using them costs minor faults only. Nothing
  else runs on the prefetch thread for it (Python work there would take the GIL from a decode
  loop that needs it);
- elsewhere (a cuda device, or a cast) it is copied out of the map into memory it owns on the
  execution device, which is freed when the block has run.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass

import torch
from safetensors import safe_open

from retarget.core.disk_weights import DiskWeight

#: safetensors header dtype names of the floating and integer types weights come in.
STORED_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class CpuSource:
    """A tensor kept resident on CPU."""

    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def prefetch(self, device: torch.device) -> torch.Tensor | None:
        """The value ahead of time: a copy for another device; None when `load` costs nothing."""
        return None if self.tensor.device == device else self.load(device)

    def load(self, device: torch.device) -> torch.Tensor:
        if self.tensor.device == device:
            return self.tensor
        return self.tensor.to(device, non_blocking=device.type == "cuda")


class SafetensorsFiles:
    """Open safetensors files, one handle and one header per file, shared by a dispatch."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}
        self._ranges: dict[str, dict[str, tuple[int, int]]] = {}
        self._dtypes: dict[str, dict[str, torch.dtype | None]] = {}
        self._lock = threading.Lock()

    def handle(self, file: str):
        with self._lock:
            if file not in self._handles:
                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            return self._handles[file]

    def byte_range(self, file: str, key: str) -> tuple[int, int]:
        """(offset from the start of the file, length) of `key`'s data."""
        with self._lock:
            if file not in self._ranges:
                with open(file, "rb") as stream:
                    (length,) = struct.unpack("<Q", stream.read(8))
                    header = json.loads(stream.read(length))
                ranges, dtypes = {}, {}
                for name, entry in header.items():
                    if name != "__metadata__":
                        begin, end = entry["data_offsets"]
                        ranges[name] = (8 + length + begin, end - begin)
                        dtypes[name] = STORED_DTYPES.get(entry["dtype"])
                self._ranges[file] = ranges
                self._dtypes[file] = dtypes
            return self._ranges[file][key]

    def stored_dtype(self, file: str, key: str) -> torch.dtype | None:
        """The dtype `key` is stored in (None for one this table does not name)."""
        self.byte_range(file, key)
        return self._dtypes[file][key]

    def warm(self, file: str, key: str) -> None:
        """Start reading `key`'s bytes into the page cache (the kernel's readahead, which
        returns at once and costs nothing for pages already cached; no memory is kept)."""
        offset, length = self.byte_range(file, key)
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._handles.clear()


@dataclass(frozen=True)
class DiskSource:
    """A tensor read from `record.file` under `record.key` each time its module runs."""

    record: DiskWeight
    files: SafetensorsFiles

    @property
    def nbytes(self) -> int:
        return self.record.nbytes

    def prefetch(self, device: torch.device) -> torch.Tensor | None:
        """Ahead of time: for a tensor used from the map, ask the kernel to read its pages now
        (None: `load` then only maps them, from the page cache); else the loaded copy."""
        if device.type == "cpu" and self.record.torch_dtype == self._stored_dtype():
            self.files.warm(self.record.file, self.record.key)
            return None
        return self.load(device)

    def _stored_dtype(self) -> torch.dtype | None:
        return self.files.stored_dtype(self.record.file, self.record.key)

    def load(self, device: torch.device) -> torch.Tensor:
        mapped = self.files.handle(self.record.file).get_tensor(self.record.key)
        if tuple(mapped.shape) != tuple(self.record.shape):
            raise ValueError(
                f"{self.record.file}:{self.record.key} has shape {tuple(mapped.shape)}, the "
                f"offload record says {self.record.shape}"
            )
        wanted = self.record.torch_dtype
        if device.type == "cpu" and mapped.dtype == wanted:
            return mapped
        owned = torch.empty(mapped.shape, dtype=wanted, device=device)
        owned.copy_(mapped)
        return owned
