"""Where an offloaded tensor comes from, and how it is brought to the execution device.

A `CpuSource` holds a resident CPU tensor: on a CPU execution device it is used as is (no
copy); elsewhere it is copied there. A `DiskSource` names a tensor in a safetensors file:
- on a CPU execution device, in the dtype it is stored in, the tensor is used straight from the
  file's memory map (`safe_open(...).get_tensor` maps, it does not read): no copy, and its pages
  are file pages the kernel may drop, never anonymous memory. Loading it ahead of time
  (`warm`) asks the kernel to read its byte range (posix_fadvise WILLNEED) and touches one
  byte per page, so the page faults are taken on the prefetch thread, not in the block;
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


@dataclass(frozen=True)
class CpuSource:
    """A tensor kept resident on CPU."""

    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def load(self, device: torch.device, warm: bool = False) -> torch.Tensor:
        if self.tensor.device == device:
            return self.tensor
        return self.tensor.to(device, non_blocking=device.type == "cuda")


class SafetensorsFiles:
    """Open safetensors files, one handle and one header per file, shared by a dispatch."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}
        self._ranges: dict[str, dict[str, tuple[int, int]]] = {}
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
                ranges = {}
                for name, entry in header.items():
                    if name != "__metadata__":
                        begin, end = entry["data_offsets"]
                        ranges[name] = (8 + length + begin, end - begin)
                self._ranges[file] = ranges
            return self._ranges[file][key]

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


PAGE = os.sysconf("SC_PAGE_SIZE")


def touch_pages(mapped: torch.Tensor) -> None:
    """Read one byte of every page of a memory-mapped tensor: the page faults (reading from
    disk, or mapping a cached page) happen here, on the prefetch thread, not in the block."""
    if mapped.numel():
        flat = mapped.reshape(-1).view(torch.uint8)
        int(flat[::PAGE].sum())


@dataclass(frozen=True)
class DiskSource:
    """A tensor read from `record.file` under `record.key` each time its module runs."""

    record: DiskWeight
    files: SafetensorsFiles

    @property
    def nbytes(self) -> int:
        return self.record.nbytes

    def load(self, device: torch.device, warm: bool = False) -> torch.Tensor:
        mapped = self.files.handle(self.record.file).get_tensor(self.record.key)
        if tuple(mapped.shape) != tuple(self.record.shape):
            raise ValueError(
                f"{self.record.file}:{self.record.key} has shape {tuple(mapped.shape)}, the "
                f"offload record says {self.record.shape}"
            )
        wanted = self.record.torch_dtype
        if device.type == "cpu" and mapped.dtype == wanted:
            if warm:
                self.files.warm(self.record.file, self.record.key)
                touch_pages(mapped)
            return mapped
        owned = torch.empty(mapped.shape, dtype=wanted, device=device)
        owned.copy_(mapped)
        return owned
