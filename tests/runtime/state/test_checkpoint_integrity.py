"""Checkpoint integrity: SHA-256 per file in the manifest, verified on load; resume_from_latest.

A flipped byte and a truncated shard are refused with the file named; loading the project's
latest checkpoint skips a damaged newest one (with a warning) for the previous intact one.
"""

from __future__ import annotations

import json

import pytest
import torch

from retarget.runtime.state.checkpoint import (
    ProjectConfig,
    load_state,
    numbered_checkpoints,
    resume_from_latest,
    save_state,
)
from retarget.runtime.state.folder import MANIFEST, DamagedCheckpointError, file_sha256


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(model, opt) -> None:
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def tensor_file(folder):
    return next(p for p in sorted(folder.rglob("*")) if p.suffix in (".distcp", ".safetensors"))


def test_the_manifest_holds_each_files_sha256(tmp_path):
    model, opt = tiny()
    step(model, opt)
    folder = save_state(tmp_path / "ckpt", model=model, optimizers=opt)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["sha256"].keys() == manifest["files"].keys() and manifest["files"]
    for name, digest in manifest["sha256"].items():
        assert file_sha256(folder / name) == digest


def test_a_flipped_byte_is_refused_with_the_file_named(tmp_path):
    model, opt = tiny()
    step(model, opt)
    folder = save_state(tmp_path / "ckpt", model=model, optimizers=opt)
    damaged = tensor_file(folder)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
    damaged.write_bytes(bytes(data))
    name = str(damaged.relative_to(folder))
    with pytest.raises(DamagedCheckpointError, match=rf"content of {name} differs"):
        load_state(folder, model=model, optimizers=opt)


def test_a_truncated_shard_is_refused_with_the_file_named(tmp_path):
    model, opt = tiny()
    folder = save_state(tmp_path / "ckpt", model=model, optimizers=opt)
    damaged = tensor_file(folder)
    damaged.write_bytes(damaged.read_bytes()[:-7])
    name = str(damaged.relative_to(folder))
    with pytest.raises(DamagedCheckpointError, match=rf"wrong size: {name}"):
        load_state(folder, model=model, optimizers=opt)


def test_latest_skips_a_damaged_newest_checkpoint_for_the_previous(tmp_path):
    model, opt = tiny()
    project = ProjectConfig(project_dir=tmp_path)
    for index in range(3):
        step(model, opt)
        save_state(model=model, optimizers=opt, step=index, project=project)
    expected = [p.detach().clone() for p in model.parameters()]  # what checkpoint_2 holds
    newest = numbered_checkpoints(project)[-1]
    damaged = tensor_file(newest)
    damaged.write_bytes(damaged.read_bytes()[:-3])
    fresh, fresh_opt = tiny()
    with pytest.warns(UserWarning, match=r"checkpoint_2 is damaged.*previous checkpoint"):
        point = load_state(model=fresh, optimizers=fresh_opt, project=project)
    assert point.path.name == "checkpoint_1" and point.step == 1
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected, strict=True))


def test_resume_from_latest_starts_fresh_then_resumes(tmp_path):
    model, opt = tiny()
    assert resume_from_latest(tmp_path, model=model, optimizers=opt) is None
    step(model, opt)
    save_state(model=model, optimizers=opt, step=7, project=ProjectConfig(project_dir=tmp_path))
    fresh, fresh_opt = tiny()
    point = resume_from_latest(tmp_path, model=fresh, optimizers=fresh_opt)
    assert point.step == 7
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    model, opt = tiny()
    folder = save_state(model=model, optimizers=opt, project=ProjectConfig(project_dir=tmp_path))
    damaged = tensor_file(folder)
    damaged.write_bytes(damaged.read_bytes()[:-1])
    with pytest.raises(DamagedCheckpointError, match="checkpoint_0 is damaged"):
        resume_from_latest(tmp_path, model=model, optimizers=opt)
