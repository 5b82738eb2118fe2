"""A retarget checkpoint written as Accelerate's: the way back for a user who leaves retarget.

`retarget convert-checkpoint SRC DST` reads a complete checkpoint folder that `save_state`
wrote (any target, any world size: DCP's shards are joined into whole tensors) and writes the
files accelerate 1.15's `Accelerator.load_state(DST)` reads (checkpoint_folder.py reads the
same layout the other way):

    model.safetensors / model_<i>.safetensors   whole weights, keyed as the user's model is
                                                (Accelerate keeps the model it was handed, and
                                                loads into it, under DDP too)
    optimizer.bin / optimizer_<i>.bin           optimizer.state_dict(): parameters by position
    scheduler.bin / scheduler_<i>.bin           scheduler.state_dict()
    scaler.pt                                   GradScaler.state_dict() (fp16 runs)
    custom_checkpoint_<i>.pkl                   a registered object's state_dict()
    random_states_<rank>.pkl                    step and Python/NumPy/torch RNG states, per rank

Accelerate continues the run with the same processes, bit for bit where its own step is the
same computation. What has no place in Accelerate's layout is refused by name before anything
is written (a model with several optimizers: torch's state-dict helpers merge their groups),
and what Accelerate keeps
in another way is left out with a line in the summary (data loader positions: Accelerate's
scripts skip the batches seen with `skip_first_batches`; a GPU's RNG state of another device
than `cuda:0`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from retarget.compat.accelerate.checkpoint_folder import numbered_file
from retarget.runtime.state.codec import decode, read_tree
from retarget.runtime.state.folder import CheckpointError, verify_folder


@dataclass
class Conversion:
    """What `write_accelerate_checkpoint` wrote and what it left out (and why)."""

    folder: Path
    written: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"wrote {self.folder} (Accelerate's layout): {', '.join(self.written)}"]
        lines += [f"not carried: {line}" for line in self.left_out]
        return "\n".join(lines)


def write_accelerate_checkpoint(source: str | Path, destination: str | Path) -> Conversion:
    """Write the retarget checkpoint `source` as an Accelerate checkpoint folder `destination`
    (new, or an empty folder). The folder appears complete or not at all."""
    source, destination = Path(source), Path(destination)
    manifest = verify_folder(source, world_size=None)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise CheckpointError(
            f"{destination} exists and is not an empty folder: name a new one (convert-checkpoint "
            "never writes over files)"
        )
    ranks = [read_tree(source / f"rank_{r}") for r in range(manifest.world_size)]
    trees = _model_trees(source)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        done = Conversion(folder=destination)
        _write_models(staging, trees, done)
        _write_per_run(staging, ranks[0], done)
        for rank, state in enumerate(ranks):
            torch.save(_random_states(state, rank, done), staging / f"random_states_{rank}.pkl")
        done.written.append(", ".join(f"random_states_{r}.pkl" for r in range(len(ranks))))
        if any(state["dataloaders"] for state in ranks):
            done.left_out.append(
                "data loader positions (Accelerate does not save them for map-style datasets: "
                "skip the batches already seen with accelerator.skip_first_batches)"
            )
        if destination.exists():
            destination.rmdir()
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return done


def _model_trees(source: Path) -> list[dict[str, Any]]:
    """Per model `{"model": state dict, "optim": state dict keyed by names}`: DCP's tensors
    joined whole (however they were sharded), put into the skeleton save_state wrote."""
    saved = json.loads((source / "model_state.json").read_text())
    for index, fresh in enumerate(saved["fresh_optimizers"]):
        if len(fresh) > 1:
            raise CheckpointError(
                f"{source}: model {index} has {len(fresh)} optimizers, saved as one merged "
                "state (torch's get_state_dict); Accelerate's layout keeps one file per optimizer "
                "and the merged groups cannot be told apart: convert a run with one optimizer "
                "per model"
            )
    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "tensors.pt"
        dcp_to_torch_save(source / "model", whole)
        tensors = torch.load(whole, weights_only=True)
    trees = decode(saved["skeleton"], tensors)["models"]
    for index, (tree, fresh) in enumerate(zip(trees, saved["fresh_optimizers"], strict=True)):
        if fresh and fresh[0] and not tree.get("groups"):
            raise CheckpointError(
                f"{source}: model {index}'s optimizer had no state when it was saved, and this "
                "checkpoint is older than the one saving such an optimizer's hyperparameters: "
                "save it again with this retarget"
            )
    return trees


def _write_models(staging: Path, trees: list[dict[str, Any]], done: Conversion) -> None:
    for index, tree in enumerate(trees):
        weights = {k: v.contiguous() for k, v in tree["model"].items()}
        name = numbered_file("model", index, "safetensors")
        save_file(weights, staging / name, metadata={"format": "pt"})
        done.written.append(name)
        optimizer = None
        if "optim" in tree:
            optimizer = _by_position(tree["optim"])
        elif tree.get("groups"):  # no state (not stepped, or plain SGD): hyperparameters only
            optimizer = _stateless(tree["groups"][0])
        if optimizer is not None:
            name = numbered_file("optimizer", index, "bin")
            torch.save(optimizer, staging / name)
            done.written.append(name)


def _by_position(optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names as `optimizer.state_dict()` keys it: by
    position, counted over the groups in order (what load_state_dict matches them by)."""
    position: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        names = group["params"]
        start = len(position)
        position.update({name: start + i for i, name in enumerate(names)})
        groups.append({**group, "params": [position[name] for name in names]})
    state = {position[name]: value for name, value in optim["state"].items()}
    return {"state": state, "param_groups": groups}


def _stateless(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """`optimizer.state_dict()` of an optimizer with no state, from its saved param groups
    (which hold the number of their parameters in `params`)."""
    start, out = 0, []
    for group in groups:
        out.append({**group, "params": list(range(start, start + group["params"]))})
        start += group["params"]
    return {"state": {}, "param_groups": out}


def _write_per_run(staging: Path, state: dict[str, Any], done: Conversion) -> None:
    """What every rank holds alike, from rank 0: schedulers, the scaler, registered objects."""
    for index, scheduler in enumerate(state["schedulers"]):
        name = numbered_file("scheduler", index, "bin")
        torch.save(scheduler, staging / name)
        done.written.append(name)
    if state["scaler"] is not None:
        torch.save(state["scaler"]["grad_scaler"], staging / "scaler.pt")
        done.written.append("scaler.pt")
    for index, custom in enumerate(state["custom_objects"]):
        name = f"custom_checkpoint_{index}.pkl"
        torch.save(custom, staging / name)
        done.written.append(name)


def _random_states(state: dict[str, Any], rank: int, done: Conversion) -> dict[str, Any]:
    """Accelerate's `random_states_<rank>.pkl` dict from the rank's saved RNG states."""
    rng = state["rng"]
    numpy = rng["numpy"]
    states: dict[str, Any] = {
        "step": state["step"],
        "random_state": rng["python"],
        # np.random.get_state()'s legacy tuple, which np.random.set_state reads
        "numpy_random_seed": (
            numpy["bit_generator"],
            np.asarray(numpy["key"], dtype=np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["gauss"],
        ),
        "torch_manual_seed": rng["torch_cpu"],
    }
    device = rng.get("device")
    if device == "cuda:0" or device == "cuda":
        states["torch_cuda_manual_seed"] = [rng["device_state"]]
    elif device is not None:
        done.left_out.append(
            f"rank {rank}'s {device} RNG state (Accelerate sets every visible device's state "
            "from one list; only cuda:0's is saved per rank)"
        )
    return states
