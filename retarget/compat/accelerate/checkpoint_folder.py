"""Accelerate's checkpoints: a folder written by `accelerate.Accelerator.save_state`, read into
a retarget run so it continues where the Accelerate run stopped.

Accelerate 1.15 writes, for a run's i-th model, optimizer, scheduler, registered object:

    model.safetensors / model_<i>.safetensors       weights (pytorch_model[_<i>].bin unsafe)
    optimizer.bin / optimizer_<i>.bin               optimizer.state_dict(), pickled
    scheduler.bin / scheduler_<i>.bin               scheduler.state_dict(), pickled
    sampler[_<i>].bin, dl_state_dict[_<i>].bin      data loader samplers (pickled objects)
    scaler.pt                                       GradScaler.state_dict(), pickled
    random_states_<rank>.pkl                        step and Python/NumPy/torch RNG states
    custom_checkpoint_<i>.pkl                       a registered object's state_dict()

Every pickle is read with `torch.load(weights_only=True)`: tensors and plain Python data only,
plus NumPy's array reconstruction in random_states_*.pkl (the NumPy generator state). A file
holding anything else is refused with `UnsafeCheckpointFileError`, naming the file and the types,
before any object is touched by it. Samplers are pickled objects (the dataset inside): they are
not read; a retarget loader keeps its own order, and the script skips the batches already seen
(`skip_first_batches`), as it would under Accelerate.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from retarget.runtime.state.folder import MANIFEST, CheckpointError
from retarget.runtime.state.save_model import tied_weights

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # NumPy 1
    from numpy.core.multiarray import _reconstruct

#: What a NumPy generator state needs beyond plain data (np.random.get_state()'s array), under
#: both NumPy 2's and NumPy 1's module names (a file may come from either).
_NUMPY_STATE_TYPES = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
]
_SAMPLER_FILES = re.compile(r"(sampler|dl_state_dict)(_\d+)?\.bin")


class UnsafeCheckpointFileError(CheckpointError):
    """A pickled file holds types that loading would have to construct (code could run)."""


@dataclass(frozen=True)
class AccelerateObjects:
    """The objects of a retarget run that an Accelerate checkpoint is loaded into."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    grad_scaler: torch.amp.GradScaler | None
    custom_objects: list[Any]


def is_accelerate_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` was written by Accelerate's save_state (not by retarget's): it has
    no manifest and the RNG file every process of an Accelerate run writes."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / MANIFEST).exists():
        return False
    return any(folder.glob("random_states_*.pkl"))


def read_pickle(path: Path, allowed: list[Any] = ()) -> Any:
    """`torch.load(path, weights_only=True)` with `allowed` globals; anything else refused."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = _globals_in(path)
        allowed_names = {t[1] if isinstance(t, tuple) else _name(t) for t in allowed}
        refused = [name for name in found if name not in allowed_names] or found
        raise UnsafeCheckpointFileError(
            f"{path} holds {', '.join(refused)}: refused, since unpickling it would construct "
            "that type (and could run code); only tensors and plain Python data are read "
            "from Accelerate's pickled files"
        ) from error


def _globals_in(path: Path) -> list[str]:
    """The types a pickled file names beyond the default allow-list (read, never run)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except ValueError:  # a bare pickle, not torch.save's zip: list every global it names
        names, strings = [], []
        for opcode, arg, _ in pickletools.genops(path.read_bytes()):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
        return names or ["a bare pickle (not written by torch.save)"]


def _name(kind: Any) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def load_accelerate_state(folder: str | Path, objects: AccelerateObjects, *, rank: int) -> int:
    """Load Accelerate's checkpoint `folder` into `objects`; returns the saved `step`.

    Every file is checked and read before the first object changes, so a refused file leaves
    the run as it was. RNG states are restored last.
    """
    folder = Path(folder)
    _check_counts(folder, objects)
    weights = [_read_weights(folder, i) for i in range(len(objects.models))]
    optimizers = [
        read_pickle(folder / numbered_file("optimizer", i)) for i in range(len(objects.optimizers))
    ]
    schedulers = [
        read_pickle(folder / numbered_file("scheduler", i)) for i in range(len(objects.schedulers))
    ]
    scaler = None
    if objects.grad_scaler is not None:
        scaler = read_pickle(_required(folder / "scaler.pt", "the run has a loss scaler"))
    custom = [
        read_pickle(folder / f"custom_checkpoint_{i}.pkl")
        for i in range(len(objects.custom_objects))
    ]
    rng_file = _required(folder / f"random_states_{rank}.pkl", f"this is process {rank}")
    rng = read_pickle(rng_file, _NUMPY_STATE_TYPES)
    skipped = sorted(p.name for p in folder.iterdir() if _SAMPLER_FILES.fullmatch(p.name))
    if skipped:
        warnings.warn(
            f"{folder}: {', '.join(skipped)} not loaded (Accelerate's sampler and data loader "
            "states); retarget's loaders keep their own order: skip the batches already seen with "
            "skip_first_batches",
            stacklevel=3,
        )

    for model, state in zip(objects.models, weights, strict=True):
        _load_weights(model, state, folder)
    for optimizer, state in zip(objects.optimizers, optimizers, strict=True):
        optimizer.load_state_dict(state)
    for scheduler, state in zip(objects.schedulers, schedulers, strict=True):
        scheduler.load_state_dict(state)
    if scaler is not None:
        objects.grad_scaler.load_state_dict(scaler)
    for obj, state in zip(objects.custom_objects, custom, strict=True):
        obj.load_state_dict(state)
    _restore_rng(rng)
    return int(rng.get("step", 0))


def numbered_file(stem: str, index: int, ext: str = "bin") -> str:
    """Accelerate's name for the `index`-th file of a kind: `optimizer.bin`, `optimizer_1.bin`."""
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def _required(path: Path, why: str) -> Path:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {path.name}, which is needed because {why}")
    return path


def _count(folder: Path, pattern: str) -> int:
    regex = re.compile(pattern)
    return sum(1 for p in folder.iterdir() if regex.fullmatch(p.name))


def _check_counts(folder: Path, objects: AccelerateObjects) -> None:
    saved = {
        "models": _count(folder, r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)"),
        "optimizers": _count(folder, r"optimizer(_\d+)?\.bin"),
        "schedulers": _count(folder, r"scheduler(_\d+)?\.bin"),
        "custom objects": _count(folder, r"custom_checkpoint_\d+\.pkl"),
    }
    given = {
        "models": len(objects.models),
        "optimizers": len(objects.optimizers),
        "schedulers": len(objects.schedulers),
        "custom objects": len(objects.custom_objects),
    }
    differ = [
        f"{what}: saved {saved[what]}, given {given[what]}"
        for what in saved
        if saved[what] != given[what]
    ]
    if differ:
        raise CheckpointError(
            f"{folder} (an Accelerate checkpoint) holds other objects than this run prepared "
            f"({'; '.join(differ)}): prepare and register the same ones, in the same order"
        )


def _read_weights(folder: Path, index: int) -> dict[str, torch.Tensor]:
    safe = folder / numbered_file("model", index, "safetensors")
    if safe.is_file():
        return load_file(safe)
    return read_pickle(
        _required(folder / numbered_file("pytorch_model", index), f"model {index} is prepared")
    )


def _load_weights(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Full tensors into the model, whatever target shards or wraps it; tied keys Accelerate
    dropped from safetensors (the copies of one tensor) may be missing."""
    # DCP's module imports DTensor and FSDP (0.7 s): imported when a checkpoint is read
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(model, state, options=options)
    missing = set(result.missing_keys) - set(tied_weights(model))
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{folder}: the saved weights do not fit the model (missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)})"
        )


def _restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
