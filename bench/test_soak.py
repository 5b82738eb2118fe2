"""Soak: 2 ranks, 2,000 small ddp steps, a checkpoint every 100 with total_limit=3. Disk holds
3 checkpoints (and no leftover staging folder) after every save, each rank's RSS grows < 5%
after warm-up, open file descriptors and threads do not grow (counted), and the final
checkpoint resumes bitwise: 10 more steps from it equal 10 more steps of the run that saved it.

A long check, not a unit test, so it lives here and runs by hand (about 15 s):
`python -m pytest bench/test_soak.py`."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.soak

STEPS, EVERY, LIMIT, WARM_UP, MORE = 2000, 100, 3, 500, 10


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _counts(project_dir: Path) -> dict:
    checkpoints = project_dir / "checkpoints"
    entries = sorted((p.name for p in checkpoints.iterdir()), key=lambda n: (len(n), n))
    return {
        "rss_kib": _rss_kib(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "entries": entries,
        "bytes": sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file()),
    }


def _soak(rank: int, world: int, root: str, resume: bool) -> dict:
    import retarget
    from retarget.execution.process import ProcessState
    from retarget.runtime.state.checkpoint import ProjectConfig, resume_from_latest, save_state
    from retarget.runtime.state.save_model import get_state_dict

    ProcessState.current()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )
    compiled = retarget.compile_for(model, "ddp", example_inputs=(torch.randn(8, 16),))
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    project = ProjectConfig(project_dir=root, total_limit=LIMIT)
    start = 0
    if resume:
        start = resume_from_latest(project, model=compiled, optimizers=[optimizer]).step
    samples = []
    for step in range(start, STEPS + MORE):
        data = torch.Generator().manual_seed(10_000 * rank + step)
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % EVERY == 0 and step < STEPS:
            save_state(model=compiled, optimizers=[optimizer], step=step + 1, project=project)
            samples.append({"step": step + 1, **_counts(Path(root))})
    weights = {k: v.clone() for k, v in get_state_dict(compiled).items()}
    return {"samples": samples, "weights": weights, "start": start}


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    from tests.distributed import run_ranks

    root = tmp_path_factory.mktemp("soak")
    first = run_ranks(_soak, 2, str(root), False, timeout=900)
    resumed = run_ranks(_soak, 2, str(root), True, timeout=300)
    return first, resumed


def test_disk_holds_total_limit_checkpoints_after_every_save(soaked):
    first, _ = soaked
    samples = first[0]["samples"]
    assert [s["step"] for s in samples] == list(range(EVERY, STEPS + 1, EVERY))
    for sample in samples:
        saves = sample["step"] // EVERY
        expected = [f"checkpoint_{n}" for n in range(max(0, saves - LIMIT), saves)]
        assert sample["entries"] == expected, sample  # no staging folder left behind either
    sizes = {s["bytes"] for s in samples[LIMIT - 1 :]}
    assert max(sizes) <= min(sizes) * 1.01  # three checkpoints, of one size


@pytest.mark.parametrize("rank", [0, 1])
def test_rss_file_descriptors_and_threads_do_not_grow_after_warm_up(soaked, rank):
    first, _ = soaked
    samples = first[rank]["samples"]
    warm = next(s for s in samples if s["step"] == WARM_UP)
    last = samples[-1]
    assert last["rss_kib"] < warm["rss_kib"] * 1.05, (warm["rss_kib"], last["rss_kib"])
    for key in ("fds", "threads", "os_threads"):
        assert [s[key] for s in samples if s["step"] >= WARM_UP] == [warm[key]] * (
            1 + (STEPS - WARM_UP) // EVERY
        ), key


def test_the_final_checkpoint_resumes_bitwise(soaked):
    first, resumed = soaked
    assert resumed[0]["start"] == resumed[1]["start"] == STEPS
    expected, got = first[0]["weights"], resumed[0]["weights"]  # full weights, on rank 0
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
