"""The files of a checkpoint and what each tensor in them is, read from headers only.

Layouts understood (`checkpoint` is a file or a folder):
- one file: `model.safetensors` (or any `.safetensors` file), or a `.bin` / `.pt` file;
- sharded: `model.safetensors.index.json` (or `pytorch_model.bin.index.json`) naming the shard
  of every key, as `save_model` and Hugging Face's `save_pretrained` write it; save_model's
  `metadata.tied_weights` (dropped key -> kept key) is read back as aliases;
- a folder holding exactly one of the above.

Only headers are read here (safetensors' JSON header; a .bin is opened with `mmap=True`, so its
tensors are not read either): shapes and dtypes are known before a single tensor is loaded, so
every bad input is refused before the model is touched.

A safetensors tensor is read with one `readinto` into memory the tensor owns. Not through
`safe_open(...).get_tensor`: in safetensors 0.8 that returns a tensor backed by the file's
memory map (docs/facts.md), so a model loaded that way would hold pages of a file that a later
save into the same folder may truncate or rewrite under it. `mapped=True` asks for exactly
that (no anonymous memory for the weights, as Accelerate loads them), knowingly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from retarget.core.errors import CheckpointError
from retarget.targets.values import parse_dtype

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint: where it is and what it is (from the header)."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0
    """Byte offset of the data in a safetensors file."""
    nbytes: int = 0

    @property
    def is_safetensors(self) -> bool:
        return self.file.suffix == ".safetensors"


@dataclass
class CheckpointFiles:
    """Every stored tensor by key, and aliases (tied keys saved once) to another key."""

    tensors: dict[str, StoredTensor]
    aliases: dict[str, str] = field(default_factory=dict)
    origin: Path = Path()

    def files(self) -> list[Path]:
        return list(dict.fromkeys(t.file for t in self.tensors.values()))


def as_floating_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`dtype` ("float16", "torch.bfloat16" or a torch.dtype) checked to be floating."""
    try:
        return parse_dtype(dtype)
    except ValueError:
        raise CheckpointError(
            f"dtype={dtype!r} cannot be used to cast weights: give a floating dtype "
            "(torch.float32, torch.float16, torch.bfloat16)"
        ) from None


def find_checkpoint(checkpoint: str | Path) -> CheckpointFiles:
    """The tensors of the checkpoint at `checkpoint` (file, folder or index), headers only."""
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        indexes = [path / n for n in INDEX_NAMES if (path / n).is_file()]
        singles = [path / n for n in SINGLE_NAMES if (path / n).is_file()]
        found = indexes or singles or sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            what = ", ".join(p.name for p in found) if found else "no checkpoint file"
            raise CheckpointError(
                f"{path}: expected one of {', '.join(INDEX_NAMES + SINGLE_NAMES)} (or a single "
                f".safetensors file), found {what}"
            )
        path = found[0]
    if path.name.endswith(".index.json"):
        return _read_index(path)
    return CheckpointFiles(tensors=_read_header(path), origin=path)


def _read_index(index_path: Path) -> CheckpointFiles:
    try:
        index: dict[str, Any] = json.loads(index_path.read_text())
        weight_map: dict[str, str] = index["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index_path} is not a checkpoint index: {error}") from error
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (index_path.parent / s).is_file()]
    if missing:
        keys = [k for k, s in weight_map.items() if s == missing[0]]
        raise CheckpointError(
            f"{index_path} names shard {missing[0]} (holding {len(keys)} keys, e.g. "
            f"{keys[0]!r}), which is not in {index_path.parent}"
            + (f"; {len(missing) - 1} more shards are missing" if len(missing) > 1 else "")
        )
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        stored = _read_header(index_path.parent / shard)
        for key, file in weight_map.items():
            if file == shard and key not in stored:
                raise CheckpointError(f"{index_path} puts {key!r} in {shard}, which lacks it")
        tensors |= stored
    aliases = dict(index.get("metadata", {}).get("tied_weights", {}) or {})
    return CheckpointFiles(tensors=tensors, aliases=aliases, origin=index_path)


def _read_header(path: Path) -> dict[str, StoredTensor]:
    if path.suffix == ".safetensors":
        return _read_safetensors_header(path)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return {
        k: StoredTensor(path, k, v.dtype, tuple(v.shape))
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        try:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        except (struct.error, ValueError) as error:
            raise CheckpointError(f"{path} is not a safetensors file: {error}") from error
    start = 8 + length
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: {key!r} has dtype {entry['dtype']}, unknown here")
        begin, end = entry["data_offsets"]
        if start + end > size:
            raise CheckpointError(f"{path}: {key!r} ends past the end of the file (truncated?)")
        out[key] = StoredTensor(path, key, dtype, tuple(entry["shape"]), start + begin, end - begin)
    return out


class TensorReader:
    """Opens each file once and reads one tensor at a time (safetensors or mmap'd .bin).

    With `mapped=True` a safetensors tensor is returned as safetensors gives it: backed by the
    file's private memory map (no read now, pages come in on first use and count as file pages,
    not anonymous memory; writing the tensor copies the page, never the file).
    """

    def __init__(self, stack: ExitStack, mapped: bool = False):
        self._stack = stack
        self._mapped = mapped
        self._open: dict[Path, Any] = {}

    def read_range(self, stored: StoredTensor, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the tensor, flattened, into memory it owns: a
        safetensors tensor is read from the file for just that range."""
        if self._mapped or not stored.is_safetensors:
            return self.read(stored).reshape(-1)[start : start + count].clone()
        handle = self._handle(stored)
        size = torch.empty((), dtype=stored.dtype).element_size()
        tensor = torch.empty(count, dtype=stored.dtype)
        view = tensor.view(torch.uint8).numpy()
        handle.seek(stored.offset + start * size)
        got = handle.readinto(view)
        if got != count * size:
            raise CheckpointError(f"{stored.file}: short read of {stored.key!r} at {start}")
        return tensor

    def _handle(self, stored: StoredTensor) -> Any:
        handle = self._open.get(stored.file)
        if handle is None:
            handle = self._stack.enter_context(open(stored.file, "rb", buffering=0))
            self._open[stored.file] = handle
        return handle

    def read(self, stored: StoredTensor) -> torch.Tensor:
        if self._mapped and stored.is_safetensors:
            key = (stored.file, "mapped")
            if key not in self._open:
                handle = safe_open(stored.file, framework="pt")
                self._open[key] = self._stack.enter_context(handle)
            return self._open[key].get_tensor(stored.key)
        handle = self._open.get(stored.file)
        if handle is None:
            if stored.is_safetensors:
                handle = self._stack.enter_context(open(stored.file, "rb", buffering=0))
            else:
                handle = torch.load(stored.file, map_location="cpu", weights_only=True, mmap=True)
            self._open[stored.file] = handle
        if not stored.is_safetensors:
            return handle[stored.key].clone()  # its own memory, not the file's map
        tensor = torch.empty(stored.shape, dtype=stored.dtype)
        view = tensor.view(-1).view(torch.uint8).numpy() if stored.nbytes else None
        handle.seek(stored.offset)
        got = 0
        while got < stored.nbytes:  # one read(2) returns at most about 2 GiB
            count = handle.readinto(view[got:])
            if not count:
                break
            got += count
        if got != stored.nbytes:
            raise CheckpointError(
                f"{stored.file}: read {got} of {stored.nbytes} bytes of {stored.key!r}"
            )
        return tensor


@contextmanager
def tensor_reader(mapped: bool = False) -> Iterator[TensorReader]:
    with ExitStack() as stack:
        yield TensorReader(stack, mapped)
