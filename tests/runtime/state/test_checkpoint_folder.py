"""checkpoint_folder: atomic commit, and clear refusals of folders that are not complete."""

from __future__ import annotations

import json

import pytest

from retarget.execution.process import ProcessState
from retarget.runtime.state.folder import (
    MANIFEST,
    CheckpointError,
    IncompleteCheckpointError,
    Manifest,
    begin_save,
    commit_save,
    is_complete,
    staging_path,
    verify_folder,
)

ONE = ProcessState()  # a world of one


def _save(final, files: dict[str, bytes], *, world_size: int = 1, sharded: bool = False, **options):
    had_manifest = (final / MANIFEST).exists()
    staging = begin_save(final, ONE, **options)
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    assert (final / MANIFEST).exists() == had_manifest  # nothing final before the commit
    manifest = Manifest(world_size=world_size, sharded=sharded, contents={"step": 1})
    commit_save(final, manifest, ONE)


def test_commit_renames_the_staging_folder_and_lists_every_file(tmp_path):
    final = tmp_path / "checkpoint_0"
    _save(final, {"rank_0.json": b"{}", "model/__0_0.distcp": b"12345"})
    assert not staging_path(final).exists()
    manifest = verify_folder(final, world_size=1)
    assert manifest.files == {"model/__0_0.distcp": 5, "rank_0.json": 2}
    assert manifest.retarget_version and manifest.contents == {"step": 1}


def test_a_new_save_replaces_an_old_checkpoint_and_clears_a_stale_staging_folder(tmp_path):
    final = tmp_path / "ckpt"
    _save(final, {"old": b"1"})
    staging_path(final).mkdir()
    (staging_path(final) / "leftover").write_bytes(b"x")
    _save(final, {"new": b"22"})
    assert sorted(p.name for p in final.iterdir()) == [MANIFEST, "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_refuses_to_overwrite_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(
        CheckpointError,
        match="refusing to save into .*mine: it holds notes.txt "
        "and is not a retarget checkpoint.*overwrite=True",
    ):
        begin_save(tmp_path / "mine", ONE)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_an_empty_folder_is_written(tmp_path):
    """tempfile.TemporaryDirectory(), or an output dir the script made with os.makedirs."""
    final = tmp_path / "made"
    final.mkdir()
    _save(final, {"a": b"1"})
    assert sorted(p.name for p in final.iterdir()) == ["a", MANIFEST]
    assert is_complete(final)


def test_overwrite_writes_beside_other_files_and_keeps_them(tmp_path):
    """Accelerate's save_state writes into a folder that holds anything (a save hook's model
    files, its own earlier checkpoint); with overwrite so do we, warning, keeping its files."""
    final = tmp_path / "out"
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    (final / "a").write_bytes(b"old")
    with pytest.warns(UserWarning, match="holds a, adapter_config.json.*written beside"):
        _save(final, {"a": b"new", "b": b"2"}, overwrite=True)
    assert sorted(p.name for p in final.iterdir()) == ["a", "adapter_config.json", "b", MANIFEST]
    assert (final / "a").read_bytes() == b"new" and is_complete(final)
    assert not staging_path(final).exists()


def test_missing_folder_points_at_the_interrupted_save_and_the_complete_ones(tmp_path):
    _save(tmp_path / "checkpoint_0", {"a": b"1"})
    staging_path(tmp_path / "checkpoint_1").mkdir()
    with pytest.raises(CheckpointError) as err:
        verify_folder(tmp_path / "checkpoint_1", world_size=1)
    message = str(err.value)
    assert "no checkpoint at" in message and ".checkpoint_1.incomplete" in message
    assert "complete checkpoints next to it: checkpoint_0" in message


def test_interrupted_save_is_refused_as_incomplete(tmp_path):
    staging = staging_path(tmp_path / "checkpoint_1")
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(IncompleteCheckpointError, match="interrupted before manifest.json"):
        verify_folder(staging, world_size=1)


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a retarget checkpoint.*pytorch_model.bin"):
        verify_folder(tmp_path, world_size=1)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="does not say format='retarget-checkpoint'"):
        verify_folder(tmp_path, world_size=1)


def test_missing_and_truncated_files_are_named(tmp_path):
    final = tmp_path / "c"
    _save(final, {"rank_0.json": b"{}", "rank_0.safetensors": b"abcd", "model/x": b"1"})
    (final / "rank_0.safetensors").write_bytes(b"ab")
    (final / "model" / "x").unlink()
    with pytest.raises(IncompleteCheckpointError) as err:
        verify_folder(final, world_size=1)
    assert "missing: model/x" in str(err.value)
    assert "wrong size: rank_0.safetensors (2 bytes, expected 4)" in str(err.value)


def test_another_world_size_is_refused(tmp_path):
    _save(tmp_path / "c", {"rank_0.json": b"{}"}, world_size=2, sharded=True)
    with pytest.raises(CheckpointError, match="sharded .FSDP. checkpoint of 2 processes.*has 1"):
        verify_folder(tmp_path / "c", world_size=1)


def test_malformed_manifest_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "retarget-checkpoint", "files": {}}))
    with pytest.raises(CheckpointError, match="manifest.json is malformed"):
        verify_folder(tmp_path, world_size=1)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        verify_folder(tmp_path, world_size=1)
