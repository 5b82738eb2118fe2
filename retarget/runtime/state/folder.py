"""A checkpoint folder on disk: written atomically, checked complete before it is read.

A save that dies half way (a kill, a full disk, a lost node) must never leave something that
looks like a checkpoint. So every rank writes into a staging folder next to the target
(`.checkpoint_3.incomplete`), fsyncing its files; after a barrier rank 0 writes `manifest.json`
(every file with its size and SHA-256, the world size, the retarget and torch versions),
fsyncs it and the folders, and renames the staging folder to its final name (then fsyncs the
parent). The rename is atomic: the final name either does not exist or names a complete
folder. A previous checkpoint is never touched by a save, so it stays loadable whatever
happens to the new one.

`verify_folder` is the reading side: it says exactly what is wrong with a folder that is not a
complete checkpoint of this run (missing, interrupted, damaged: a file missing, resized or with
other bytes than its SHA-256 says, foreign, another world size), and what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from retarget.core.errors import CheckpointError
from retarget.core.version import __version__
from retarget.execution.process import ProcessState

MANIFEST = "manifest.json"
FORMAT = "retarget-checkpoint"
FORMAT_VERSION = 1
_STAGING_SUFFIX = ".incomplete"
#: Files only save_state writes: their presence without a manifest means an interrupted save.
_OUR_FILE = re.compile(r"model/.*|model_state\.json|rank_\d+\.(json|safetensors)")


class IncompleteCheckpointError(CheckpointError):
    """A save was interrupted: the folder lacks its manifest or some of the files it lists."""


class DamagedCheckpointError(IncompleteCheckpointError):
    """A complete checkpoint whose files were changed after the save: missing, resized, or
    with other bytes than their SHA-256 in the manifest says."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a complete checkpoint holds; written last, read first."""

    world_size: int
    """Processes that wrote it; per-rank state (RNG, loader position, shards) needs as many."""
    sharded: bool
    """Model or optimizer state was saved as per-rank shards (FSDP)."""
    contents: dict[str, Any]
    """How many of each part were saved (optimizers, schedulers, ...), step, accumulation step."""
    files: dict[str, int] = field(default_factory=dict)
    """Every file of the checkpoint (relative path) with its size in bytes."""
    sha256: dict[str, str] = field(default_factory=dict)
    """Every file's SHA-256 (hex), checked on load: a flipped bit is refused, not trained on."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    retarget_version: str = ""
    torch_version: str = torch.__version__


def staging_path(final: Path) -> Path:
    """Where a save to `final` writes before it is complete."""
    return final.parent / f".{final.name}{_STAGING_SUFFIX}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def begin_save(final: Path, state: ProcessState, *, overwrite: bool = False) -> Path:
    """Prepare the staging folder for a save to `final` on every rank; returns it.

    A stale staging folder (left by an interrupted save) is removed first. `final` may be new,
    an empty folder, or a retarget checkpoint (replaced once the new one is complete); a folder
    holding anything else is refused naming what it holds, unless `overwrite`: the checkpoint is
    then written beside those files (what Accelerate's save_state does), with a warning.
    """
    staging = staging_path(final)
    # Every rank checks, so that all of them stop here rather than wait for rank 0.
    foreign = _foreign_entries(final)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        if not overwrite:
            raise CheckpointError(
                f"refusing to save into {final}: it holds {shown} and is not a retarget "
                f"checkpoint (no {MANIFEST}); choose a new or empty folder, remove them, or pass "
                "overwrite=True to write the checkpoint beside them"
            )
        if state.is_main_process:
            warnings.warn(
                f"save_state: {final} holds {shown}, which is not a retarget checkpoint; the "
                "checkpoint is written beside those files, which are kept",
                stacklevel=3,
            )
    if state.is_main_process:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    state.wait_for_everyone()
    return staging


def _foreign_entries(final: Path) -> list[str]:
    """What `final` holds when it is neither new, empty nor a retarget checkpoint."""
    if not final.exists() or (final / MANIFEST).is_file():
        return []
    if not final.is_dir():
        raise CheckpointError(f"cannot save into {final}: it is a file, not a folder")
    return sorted(entry.name for entry in final.iterdir())


def commit_save(final: Path, manifest: Manifest, state: ProcessState) -> None:
    """Make the staging folder the checkpoint `final`, once every rank has written its files.

    Each rank must have fsynced its own files before calling this.
    """
    staging = staging_path(final)
    state.wait_for_everyone()
    if state.is_main_process:
        files = _listing(staging)
        hashes = {name: file_sha256(staging / name) for name in files}
        record = asdict(manifest) | {
            "files": files,
            "sha256": hashes,
            "retarget_version": __version__,
        }
        path = staging / MANIFEST
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        # File data is synced by its writer; the folders' entries must reach the disk too.
        for folder in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
            _fsync_dir(folder)
        if _foreign_entries(final):
            _commit_beside(staging, final)
        else:
            replaced = final.parent / f".{final.name}.replaced"
            if final.exists():
                if replaced.exists():
                    shutil.rmtree(replaced)
                os.replace(final, replaced)
            os.replace(staging, final)
            _fsync_dir(final.parent)
            if replaced.exists():
                shutil.rmtree(replaced)
    state.wait_for_everyone()


def _commit_beside(staging: Path, final: Path) -> None:
    """Move the staged checkpoint into `final`, which holds other files (kept): each entry
    replaces one of the same name, and the manifest comes last, so until it is in place the
    folder does not read as a complete checkpoint."""
    for entry in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST):
        target = final / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    _fsync_dir(final)
    staging.rmdir()
    _fsync_dir(final.parent)


def is_complete(folder: Path) -> bool:
    """A manifest is present (it is written last, so the save finished)."""
    return (folder / MANIFEST).is_file()


def verify_folder(folder: Path, *, world_size: int | None) -> Manifest:
    """The manifest of a complete checkpoint written by `world_size` processes (any number with
    None), or a clear error."""
    folder = Path(folder)
    if not folder.exists():
        hint = ""
        if staging_path(folder).exists():
            hint = (
                f"; an interrupted save left {staging_path(folder)}, which is incomplete and is "
                "never loaded"
            )
        siblings = sorted(p.name for p in folder.parent.glob("*") if is_complete(p))
        if siblings:
            hint += f"; complete checkpoints next to it: {', '.join(siblings)}"
        raise CheckpointError(f"no checkpoint at {folder}{hint}")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder")
    manifest_path = folder / MANIFEST
    present = _listing(folder)
    if not manifest_path.is_file():
        ours = folder.name.endswith(_STAGING_SUFFIX) or any(
            _OUR_FILE.fullmatch(name) for name in present
        )
        shown = ", ".join(list(present)[:8]) or "nothing"
        if ours:
            raise IncompleteCheckpointError(
                f"{folder} is an incomplete checkpoint: its save was interrupted before "
                f"{MANIFEST} was written (it holds {shown}). Load the previous checkpoint instead"
            )
        raise CheckpointError(
            f"{folder} is not a retarget checkpoint: it has no {MANIFEST} (it holds {shown}). "
            "Point load_state at a folder written by retarget's save_state"
        )
    try:
        record = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} is not a retarget checkpoint: {MANIFEST} does not say format={FORMAT!r}"
        )
    if record.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format {record['format_version']}, written by retarget "
            f"{record.get('retarget_version')}; this retarget reads up to {FORMAT_VERSION}: upgrade"
        )
    try:
        manifest = Manifest(
            **{f.name: record[f.name] for f in fields(Manifest) if f.name in record}
        )
    except TypeError as e:
        raise CheckpointError(f"{manifest_path} is malformed ({e})") from None
    missing = [f for f in manifest.files if f not in present]
    resized = [
        f"{f} ({present[f]} bytes, expected {size})"
        for f, size in manifest.files.items()
        if f in present and present[f] != size
    ]
    if missing or resized:
        parts = [f"missing: {', '.join(missing)}"] if missing else []
        parts += [f"wrong size: {', '.join(resized)}"] if resized else []
        raise DamagedCheckpointError(
            f"{folder} is damaged: {'; '.join(parts)}. Load another checkpoint"
        )
    altered = [
        name
        for name, digest in manifest.sha256.items()
        if name in present and file_sha256(folder / name) != digest
    ]
    if altered:
        raise DamagedCheckpointError(
            f"{folder} is damaged: the content of {', '.join(altered)} differs from what was "
            "saved (SHA-256 in the manifest). Load another checkpoint"
        )
    if world_size is not None and manifest.world_size != world_size:
        kind = "sharded (FSDP) " if manifest.sharded else ""
        raise CheckpointError(
            f"{folder} is a {kind}checkpoint of {manifest.world_size} processes, and this run "
            f"has {world_size}: its per-rank state (RNG, data position"
            f"{', parameter shards' if manifest.sharded else ''}) needs the same number. Resume "
            f"with {manifest.world_size} processes, or pass reshard=True to load_state: DCP "
            "reshards the model and optimizer onto this run, which starts its RNG and data "
            "positions afresh"
        )
    return manifest
